"""PyTorch's internals: cuBLASLt's SM carveout, the compiler's recompile limit, the bad-fork flag."""

from __future__ import annotations

from xrlhf.internals import Hook, needs


SM_CARVEOUT = Hook(
    "torch.sm_carveout", "torch", ("2.11", "2.14"),
    buys="an engine's GEMMs leave SMs free for vLLM's kernels one step off under MPS (sm_carveout)",
    without="GEMMs size themselves for the whole GPU; sm_carveout is ignored",
    probe=needs("torch._C", "_set_sm_carveout_experimental"))


def set_sm_carveout(sms: int) -> bool:
    """Tell cuBLASLt to leave ``sms`` SMs free in this process (torch then routes GEMMs through
    cuBLASLt, whose persistent kernels honour it). Returns whether it was set."""
    if not SM_CARVEOUT.active():
        return False
    import torch

    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    return True


RECOMPILE_LIMIT = Hook(
    "torch.recompile_limit", "torch", ("2.11", "2.14"),
    buys="a compiled decoder layer keeps a compiled variant for every way it is called (train, eval, "
         "frozen, LoRA, autocast) past torch's default of 8",
    without="past 8 variants a compiled layer runs eagerly (torch warns)",
    probe=needs("torch._dynamo.config", "recompile_limit"))


def allow_recompiles(limit: int) -> None:
    """Let each compiled code object keep at least ``limit`` variants (``torch._dynamo.config``)."""
    if RECOMPILE_LIMIT.active():
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


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
