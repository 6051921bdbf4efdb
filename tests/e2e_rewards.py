"""Custom rewards loaded by dotted path in the end-to-end tests."""


def digit_fraction(args, sample):
    """A dense reward, so that even a random tiny model gets a learning signal."""
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def fails_on_odd_index(args, sample):
    if sample.index % 2:
        raise RuntimeError("reward server said no")
    return 1.0
