"""strat_k in the DDP hook on 2 gloo ranks with bfloat16 models: the shared-seed values path
(DCGD, and scaled() keeping the shared seed under EF21) and the packed block offsets (DIANA):
identical parameters on the ranks after every step, and the bytes at the collectives equal
the bit formulas with 16-bit values."""

from __future__ import annotations

import pytest
import torch
from ddp_helpers import Job, expected_bytes, run

from shrinkgrad.distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(90)]

BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "job",
    [
        Job(compressor="strat_k[shared_seed=true]", ratio=0.1, dtype=BF16, record_bytes=True),
        Job(
            compressor="scaled(strat_k[k=4,shared_seed=true])",
            method="ef21",
            min_numel=16,
            dtype=BF16,
            record_bytes=True,
        ),
        Job(compressor="strat_k", ratio=0.1, method="diana", dtype=BF16, record_bytes=True),
    ],
    ids=lambda j: f"{j.compressor}-{j.method}",
)
def test_bf16_ranks_agree_and_send_the_bit_formulas(job: Job) -> None:
    results = spawn(run, 2, (job,))
    for t in range(job.steps):
        assert torch.equal(results[0]["params"][t], results[1]["params"][t]), t
    assert bool(torch.isfinite(results[0]["params"][-1]).all())
    assert not torch.equal(results[0]["params"][0], results[0]["params"][-1])
    # step 0: the dense initialisation in float32 (the method's memory is float32)
    dense = results[0]["params"][0].numel() * 4
    want = expected_bytes(job, 2, BF16)
    for r in results:
        assert r["sent"] == [dense] + [want] * (job.steps - 1)
        assert r["state_bytes"] == r["sent"]
