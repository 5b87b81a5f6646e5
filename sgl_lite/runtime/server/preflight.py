"""Setup mistakes caught before `sgl-lite serve` loads anything, each reported as one line.

The checks call the very functions the model runner uses later (device choice, TP shardability, the
model's config), so they cannot disagree with it; they only run them first, and cheaply: the config
is read, the weights are not.
"""

from __future__ import annotations

import importlib.util

from sgl_lite.runtime.server_args import ServerArgs


class SetupError(ValueError):
    """A flag that cannot work with this model or machine; the message says which and what to do."""


def check_setup(args: ServerArgs) -> None:
    from sgl_lite.runtime.model_executor import loader
    from sgl_lite.runtime.model_executor.model_runner import choose_device
    from sgl_lite.runtime.model_executor.tp import check_shardable

    try:
        device = choose_device(args.device)
    except ValueError as e:
        raise SetupError(f"{e}: use --device cpu (or auto)") from None
    _check_attention_backend(args, device.type)
    if device.type == "cuda" and args.tp_size > 1:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < args.tp_size:  # else a rank dies at set_device and rank 0 waits out the group's timeout
            raise SetupError(f"--tp-size {args.tp_size} puts one rank on each GPU, and this machine has {gpus}: "
                             f"give at most --tp-size {gpus}")
    try:
        config = loader.load_config(loader.resolve_model_path(args.model_path))
    except loader.LoaderError as e:
        raise SetupError(str(e)) from None
    max_positions = config.max_position_embeddings
    if args.context_length is not None and args.context_length > max_positions:
        raise SetupError(f"--context-length {args.context_length} exceeds the model's max_position_embeddings "
                         f"{max_positions}: give at most {max_positions}, or leave it out")
    try:
        check_shardable(config, args.tp_size)
    except ValueError as e:
        raise SetupError(str(e)) from None


def _check_attention_backend(args: ServerArgs, device_type: str) -> None:
    wants_flashinfer = args.attention_backend == "flashinfer" or (args.attention_backend == "auto" and device_type == "cuda")
    if not wants_flashinfer:
        return
    if device_type != "cuda":
        raise SetupError("--attention-backend flashinfer runs on CUDA only: use --attention-backend torch_native "
                         "(or auto) on CPU")
    if importlib.util.find_spec("flashinfer") is None:
        raise SetupError("--attention-backend flashinfer (what auto picks on CUDA) needs FlashInfer, which is not "
                         "installed: pip install flashinfer-python, or use --attention-backend torch_native")
