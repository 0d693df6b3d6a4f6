"""SFT of a dream model: `python train/sft_dream.py config=configs/sft_dream.yaml [key=value ...]`, or under
`accelerate launch --config_file accelerate_configs/<...>.yaml train/sft_dream.py config=...`. See jobs/sft.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make the repository importable

from jobs.sft_entry import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main("dream"))
