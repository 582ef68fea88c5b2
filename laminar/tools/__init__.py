"""Tools an agent's episodes call (issue 19): the sandbox that runs untrusted code."""
