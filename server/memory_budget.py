"""`--memory-budget auto`: the memory M_j a server offers, from what its device has free.

On CUDA: the device's free memory (`torch.cuda.mem_get_info`) minus a margin; on the CPU: the
kernel's MemAvailable minus a margin. The margin (`AUTO_MARGIN_FRACTION` of the total, at least
`AUTO_MARGIN_MIN_BYTES`) leaves room for what the budget does not count: activations of a batch,
CUDA graphs' pools, the CUDA context, allocator fragmentation, the client head of a co-located client.
"""

from __future__ import annotations

from petals_chain.errors import InvalidRequestError

AUTO_MARGIN_FRACTION = 0.10
AUTO_MARGIN_MIN_BYTES = 2**30


def free_and_total_bytes(device: str) -> tuple[int, int]:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidRequestError(
                f"--device {device}: this torch build sees no CUDA device; install the CUDA "
                "build of torch (README: Installing on a GPU host) or use --device cpu"
            )
        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    if dev.type == "cpu":
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        return fields["MemAvailable"], fields["MemTotal"]
    raise InvalidRequestError(f"--memory-budget auto knows cpu and cuda devices, not {device!r}; give a size")


def auto_memory_budget(device: str) -> int:
    free, total = free_and_total_bytes(device)
    budget = free - max(AUTO_MARGIN_MIN_BYTES, int(AUTO_MARGIN_FRACTION * total))
    if budget <= 0:
        raise InvalidRequestError(
            f"--memory-budget auto: {device} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB, less than "
            f"the {max(AUTO_MARGIN_MIN_BYTES, int(AUTO_MARGIN_FRACTION * total)) / 2**30:.2f} GiB margin; free memory "
            "or give --memory-budget SIZE"
        )
    return budget
