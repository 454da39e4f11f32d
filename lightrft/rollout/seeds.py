"""Per-request sampling seeds derived from the run seed, the rollout step and the prompt's place.

Every prompt of a rollout gets its own random stream, so sample j of prompt i never shares draws
with sample j of another prompt (one shared seed per call would make copies of one prompt produce
identical groups). A seed depends only on (run seed, stream, step, global prompt position), never
on how prompts are split into ranks, chunks or engine calls, so a run is reproducible and a
resumed run draws exactly what the uninterrupted one would have drawn.
"""

_MASK64 = (1 << 64) - 1

# Streams keep training rollouts, evaluation and anything else from ever sharing a seed.
STREAMS = {"train": 0, "eval": 1}


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele, Lea and Flood 2014): a bijective 64-bit mixer whose
    outputs for consecutive inputs are statistically independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2**63) that depends on every part and its order."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h >> 1


def request_seeds(run_seed: int, step: int, first_position: int, count: int, stream: str = "train",
                  stride: int = 1) -> list[int]:
    """Seeds for `count` prompts at global positions `first_position + i * stride` of rollout `step`.

    `step` counts rollouts (or evaluations) from 1; the position is the prompt's index in the
    global rollout batch (over all ranks). `DistributedSampler` deals global position k to rank
    k % R, so rank r passes `first_position=r, stride=R`: the same prompt at the same place then
    gets the same stream on any number of ranks."""
    if stream not in STREAMS:
        raise ValueError(f"unknown seed stream {stream!r}: choose one of {sorted(STREAMS)}")
    return [mix_seed(run_seed, STREAMS[stream], step, first_position + i * stride) for i in range(count)]


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` (0 ... n-1) of a prompt whose request seed is given."""
    return mix_seed(request_seed, sample_index)
