"""Custom rewards loaded by dotted path in the end-to-end tests."""


def digit_fraction(args, sample):
    """A dense reward, so that even a random tiny model gets a learning signal."""
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def fails_on_odd_index(args, sample):
    if sample.index % 2:
        raise RuntimeError("reward server said no")
    return 1.0


def constant_on_even_rows(args, sample):
    """0 for prompts of even dataset rows (a zero-spread group), a token-dependent value otherwise."""
    if sample.index % 2 == 0:
        return 0.0
    response_ids = sample.tokens[len(sample.tokens) - sample.response_length:]
    return (sum(response_ids) % 5) / 4


async def hangs(args, sample):
    """A reward server that never answers (the async loops must time out, not deadlock)."""
    import asyncio

    await asyncio.sleep(3600)


_calls = 0


def digit_fraction_then_die_once(args, sample):
    """`digit_fraction`, but the process SIGKILLs itself at call $RELAX_TEST_DIE_AT_CALL, once per marker file
    $RELAX_TEST_DIE_MARKER (a fault injected into a real run: the supervisor must restart it)."""
    import os
    import signal
    from pathlib import Path

    global _calls
    _calls += 1
    if _calls == 1 and os.environ.get("RELAX_TEST_PARENTS"):  # this process, its parent and the parent's parent
        grandparent = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[1]
        with open(os.environ["RELAX_TEST_PARENTS"], "a") as handle:
            handle.write(f"{os.getpid()} {os.getppid()} {grandparent}\n")
    marker = Path(os.environ["RELAX_TEST_DIE_MARKER"])
    if _calls == int(os.environ["RELAX_TEST_DIE_AT_CALL"]) and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return digit_fraction(args, sample)


_slept = False


def digit_fraction_slow_once(args, sample):
    """`digit_fraction`, with the first call of the process taking 3 s (a step that stalls for a while)."""
    import time

    global _slept
    if not _slept:
        _slept = True
        time.sleep(3.0)
    return digit_fraction(args, sample)


def misbehaves_on_some_rows(args, sample):
    """`digit_fraction`, except: row 1 leaks 4 GiB, row 2 kills its own process, row 3 never returns."""
    import os
    import signal
    import time

    if sample.index == 1:
        hoard = bytearray(4 << 30)
        return float(len(hoard))
    if sample.index == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if sample.index == 3:
        time.sleep(3600)
    return digit_fraction(args, sample)


def digit_fraction_paced(args, sample):
    """`digit_fraction` taking 30 ms a call: a tiny run's steps last long enough for a signal to land inside one."""
    import time

    time.sleep(0.03)
    return digit_fraction(args, sample)


def digit_fraction_held(args, sample):
    """`digit_fraction_slow` that first waits while the file $RELAX_CHAOS_HOLD exists (at most 120 s): a test holds
    a run that would otherwise outrun what the test does to it (the chaos harness's faults,
    benchmarks.chaos_cpu.run_with_faults; a scale-out). A run that uses it needs a --reward-timeout above that wait,
    or a held sample would score 0."""
    import os
    import time
    from pathlib import Path

    hold = Path(os.environ["RELAX_CHAOS_HOLD"])
    deadline = time.monotonic() + 120
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return digit_fraction_slow(args, sample)


def digit_fraction_slow(args, sample):
    """`digit_fraction` taking 100 ms a call (~1.6 s a tiny step): long enough for a relaunched engine (a few
    seconds) to come back within a few steps of a short run."""
    import time

    time.sleep(0.1)
    return digit_fraction(args, sample)


_one_at_a_time = __import__("threading").Lock()


def digit_fraction_serial(args, sample):
    """`digit_fraction` taking 100 ms a call, one call at a time whatever the reward threads: a step of 16 samples
    lasts 1.6 s on any machine (a GPU run's steps are otherwise too short for a relaunch to land in the run)."""
    import time

    with _one_at_a_time:
        time.sleep(0.1)
    return digit_fraction(args, sample)


_kept: list[bytes] = []


def leaks_into_a_global(args, sample):
    """Keeps 150 MB of every call in a global (a leak that outlives the call): under a 600 MB worker cap the worker
    runs out after a few calls, and every later call in it would fail unless it is replaced."""
    _kept.append(b"x" * (150 << 20))
    return 1.0


async def blocks_its_loop(args, sample):
    """An async reward that blocks its event loop (time.sleep inside an async def) for 30 s."""
    import time

    time.sleep(30)
    return 1.0


def sleeps_forever(args, sample):
    """A synchronous reward that never returns (its thread cannot be stopped)."""
    import time

    time.sleep(3600)


def always_raises(args, sample):
    """A reward broken for every sample (a wrong import, a renamed field)."""
    raise KeyError("no field 'answer' in this sample")
