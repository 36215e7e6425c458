"""``python -m shrinkgrad.distributed.ps CONFIG --out DIR``: one rank under torchrun."""

from .launch import main

if __name__ == "__main__":  # pragma: no cover - process entry point
    main()
