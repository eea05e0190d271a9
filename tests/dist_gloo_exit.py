"""One rank of a 2-rank gloo group that ends its process right after its last collective (the
worker of tests/test_gloo_exit.py): the exit is where a gloo worker thread that still has to
take the GIL meets a finalizing interpreter and aborts the rank.

    python tests/dist_gloo_exit.py MODE STORE_FILE RANK

Modes:
    ddp: a backward through plainrl's DDP wrapper (``Parallel.wrap``, its SUM comm hook), then
        ``leave`` as a run ends.
    then: an all-reduce whose future carries a Python ``then`` callback, the callback's future
        waited on (as DDP waits on a hook's), then exit: the hazard itself, which the test
        expects to abort (the control that it can see one).
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist


def main() -> None:
    mode, store_file, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    if mode == "then":
        fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda f: f.value()[0])
        fut.wait()  # completes once the callback ran: its collective had the group's 60 s timeout
        return  # the group is never destroyed, as in pytorch#190489's script
    from plainrl.run.distributed import leave
    from plainrl.train.distributed import Parallel

    parallel = Parallel(active=True, strategy="ddp", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    call = parallel.wrap(model)
    assert isinstance(call, torch.nn.parallel.DistributedDataParallel)
    call(lambda m, x: m(x), torch.randn(2, 16)).sum().backward()
    leave(parallel)


if __name__ == "__main__":
    main()
