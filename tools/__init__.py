"""Command-line utilities that are not jobs, each run from the repository root as ``python -m tools.<name>``:

- ``trace_viewer``: the HTML trace page of saved trajectories (the reference's ``sample/get_trace_viewer.py``);
- ``download_data``: a benchmark / RL dataset from the Hub as ``data/NAME.json`` (the reference's
  ``data/download_data.py``);
- ``write_tasks``: built-in synthetic tasks as a dataset file;
- ``check_config``: validate config files without running them;
- ``a2d``: an autoregressive checkpoint turned into a diffusion family;
- ``distill``: SFT rows from an autoregressive checkpoint's own answers (the A2D recipe's data);
- ``merge_lora``: a LoRA adapter merged into a whole checkpoint;
- ``accelerate_config``: regenerate ``accelerate_configs/*.yaml``.
"""
