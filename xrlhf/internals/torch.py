"""PyTorch's internals: the compiler's front end imported ahead, the bad-fork flag."""

from __future__ import annotations

from xrlhf.internals import Hook, needs


def import_compiler() -> None:
    """Import torch's compiler front end (``torch._dynamo``), e.g. in the fork server before it
    forks the workers that will compile."""
    import torch._dynamo  # noqa: F401


BAD_FORK = Hook(
    "torch.bad_fork_flag", "torch", ("2.11", "2.14"),
    buys="the fork server tells by a test fork whether an import touched CUDA (torch's own flag)",
    without="the fork server trusts torch.cuda.is_initialized() alone",
    probe=needs("torch.cuda", "_is_in_bad_fork"))


def in_bad_fork() -> bool:
    """In a forked child: whether its parent had initialised CUDA, which the child cannot use."""
    if not BAD_FORK.active():
        return False
    import torch

    return bool(torch.cuda._is_in_bad_fork())
