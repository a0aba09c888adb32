"""The two members of a push group, each in a process of its own (test_push.py starts them):
rank 0 pushes a small model of two dtypes to rank 1 three times — the second reusing the first's
shared buffers, a push the replica refuses (parameters of another shape) between the second and
the third — and each puts what it saw on a queue."""

import hashlib

import torch


class Small(torch.nn.Module):
    """Parameters of two dtypes (two flat buffers), seeded; wide changes a shape."""

    def __init__(self, device: torch.device, seed: int, wide: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(4, wide, generator=g).to(device))
        self.b = torch.nn.Parameter(torch.randn(16, generator=g).to(device, torch.bfloat16))
        self.c = torch.nn.Parameter(torch.randn(3, generator=g).to(device))


def digest(model) -> str:
    """The parameters' bytes, bit for bit."""
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def member(rank: int, device: str, init: str, force_shared: bool, fail_map: bool, out) -> None:
    """force_shared: the pair is linked as on one GPU whatever the devices (on the CPU the
    buffers are shared through shared memory: push.py's protocol without a GPU). fail_map: rank 1
    cannot map rank 0's buffers (the pair must fall back to gloo)."""
    from slimen_torch import push

    got: dict = {}
    try:
        if force_shared:
            torch.multiprocessing.set_sharing_strategy("file_system")
            push._link = lambda mine, theirs, nccl: "cuda-ipc"
        if fail_map and rank == 1:
            def broken(handle, device):
                raise RuntimeError("no mapping today")
            push._import = broken
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        g = push.Group("t", init, rank, 2, 60, dev)
        got["links"] = list(g.links)
        model = Small(dev, seed=1 if rank == 0 else 2)
        got["before"] = digest(model)
        other = Small(dev, seed=3, wide=9)
        pushes = []
        for i in range(4):
            err = ""
            try:
                if rank == 0:
                    with torch.no_grad():  # new weights each time, as after an optimizer step
                        for p in model.parameters():
                            p.add_(0.25 * (i + 1))
                    r = g.send(model, 1)
                else:
                    r = g.receive(other if i == 2 else model)
            except ValueError as e:
                r, err = {}, str(e)
            bufs = g._bufs.get(1, {})
            pushes.append(dict(link=r.get("link"), bytes=r.get("bytes"), error=err,
                               digest=digest(model),
                               ptrs={str(dt): b.data_ptr() for dt, b in bufs.items()}))
        got["pushes"] = pushes
        got["links_after"] = list(g.links)
        got["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        g.close()
        got["closed_bufs"] = len(g._bufs)
    except BaseException as e:  # reported to the test
        got["error"] = f"{type(e).__name__}: {e}"
    out.put((rank, got))
