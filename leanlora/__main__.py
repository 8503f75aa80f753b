"""`python -m leanlora` from the pack's folder, or `python <pack>/leanlora` from anywhere (ComfyUI's root)."""
import sys
from pathlib import Path

if not __package__:  # run as a folder: the pack's folder goes on sys.path so that `leanlora` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leanlora.cli import main  # noqa: E402

sys.exit(main())
