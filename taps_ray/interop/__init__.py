"""vLLM beside the project: its CPU build in a side venv (side.py, vllm_runner.py) judges our exported heads (check.py) and is the bench's peer."""
