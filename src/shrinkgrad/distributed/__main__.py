"""``torchrun ... -m shrinkgrad.distributed CONFIG.toml [--out DIR ...]``: ``shrinkgrad train``
run as one rank of a torchrun job (the options of ``shrinkgrad train --help``)."""

from __future__ import annotations

import sys

from ..cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
