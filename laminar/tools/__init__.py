"""Tools an agent's episodes call: the sandbox that runs untrusted code."""
