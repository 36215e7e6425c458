"""Example parameters for every registered compressor (the contract suite runs on all of them).

A compressor registered without an entry here makes ``test_every_compressor_has_examples``
fail, so the contract tests cannot silently skip it. Every example must be valid at the test
dimension D (and its constant must exist there).
"""

from __future__ import annotations

#: dimension used by the contract tests
D = 20

EXAMPLES: dict[str, list[str]] = {
    "identity": ["identity"],
    "top_k": ["top_k[k=1]", "top_k[k=3]"],
    "rand_k": ["rand_k[k=3]", "rand_k[k=2,shared_seed=true]"],
    "rand_k_scaled": ["rand_k_scaled[k=3]"],
    # D = 20: blocks of 6, 7, 7 (offsets of 3 bits); blocks of 5 (indices redrawn)
    "strat_k": ["strat_k[k=3]", "strat_k[k=4,shared_seed=true]"],
    "bernoulli": ["bernoulli[p=0.3]"],
    "lazy_bernoulli": ["lazy_bernoulli[p=0.4]"],
    "qsgd": ["qsgd[s=1]", "qsgd[s=4]"],
    "ternary": ["ternary"],
    "standard_dithering": [
        "standard_dithering[s=3,norm=inf]",
        "standard_dithering[s=4,norm=2]",  # = qsgd[s=4]
        "standard_dithering[s=1,norm=inf]",  # = ternary
    ],
    "natural": ["natural"],
    "natural_dithering": [
        "natural_dithering[s=2]",
        "natural_dithering[s=5]",
        "natural_dithering[s=3,norm=inf]",
    ],
    "scaled_sign": ["scaled_sign"],
    "rank_k": ["rank_k[r=1]", "rank_k[r=2,rows=5]"],  # D = 20: the 4 × 5 view, then 5 × 4
    "power_sgd": [
        "power_sgd[rank=1]",
        "power_sgd[rank=2,alpha=0.1]",
        "power_sgd[rank=2,shared=true]",
    ],
    "scaled": [
        "scaled(qsgd[s=2])",
        "scaled(rand_k[k=3])",
        "scaled(strat_k[k=3])",  # its exact scaled form: C/⌈d/k⌉, one rounding
        "scaled(natural)",
        "scaled(bernoulli[p=0.5])",  # random message size
    ],
    "compose": [
        "compose(top_k[k=4],qsgd[s=4])",  # projection, then unbiased on the k values
        "compose(rand_k_scaled[k=6],qsgd[s=4])",  # random projection, then unbiased
        "compose(top_k[k=5],scaled_sign)",  # deterministic, contractive ∘ contractive
        "compose(rand_k[k=4],natural)",  # unbiased ∘ unbiased on the k values
        "compose(strat_k[k=4],natural)",  # the same with the blocks' offsets as indices
        "compose(natural,qsgd[s=8])",  # unbiased ∘ unbiased, dense
        "compose(natural,top_k[k=16])",  # unbiased, then contractive (Minkowski)
        "compose(scaled(natural),qsgd[s=16])",  # contractive, then unbiased
        "compose(scaled(natural),top_k[k=19])",  # contractive ∘ contractive (Minkowski)
        "compose(top_k[k=6],bernoulli[p=0.7])",  # random message size on the k values
    ],
}

ALL = [spec for specs in EXAMPLES.values() for spec in specs]
