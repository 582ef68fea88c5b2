"""The model recipe of a task: tokenizer, a small Qwen2 model, SFT warm start, evaluation.

``laminar model init`` -> ``laminar sft`` -> ``laminar eval`` turn a task module (see
:mod:`laminar.recipe.tasks`) into an HF model directory that the trainer and vLLM rollouts load.
Importing this package imports nothing heavy; torch and transformers load inside the commands.
"""
