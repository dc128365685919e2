"""
Fully sharded training (base_train --sharding=fsdp): PyTorch's FSDP2 (`fully_shard`) holds every parameter, its
gradient and its optimizer state as 1/world_size row-shards (DTensors on dim 0); a block's whole weights exist only
while one of its visits runs.

- Every Block (recursion, prelude, coda) is its own FSDP unit; `Block.visit` is registered as a forward method, so
  each layer visit of the recursion (its n_loops+1 block calls) gathers the block's weights once and frees them
  after (reshard after forward), and its backward gathers them again and reduce-scatters the gradient. Each unit
  prefetches its neighbour's gather, forward and backward (set_prefetch).
- The root unit (embedding, lm_head, halting head) is gathered for a whole `GPT.forward_backward` (registered as a
  forward method): its several backward calls per micro-step read lm_head throughout, so the root is not freed
  between them (reshard after backward off) and is freed when the micro-step ends. FSDP ends its iteration (its
  root, whose pre-forward orders the gathers after all queued compute) at every backward; forward_backward's
  backward calls keep it (one_iteration_per_micro_step), so no block call becomes a root of its own.
- The optimizers work on the shards: AdamW is elementwise; ShardedMuon sends each matrix's rows to the rank that
  owns it, orthogonalises whole matrices there and sends every rank its rows of the update.
"""

import sys

import torch
import torch.distributed as dist

from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train.optim import AdamW, Muon, ShardedMuon


def is_sharded(model):
    """Without importing FSDP: a model is sharded only once torch.distributed.fsdp was imported (by shard_model)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def shard_model(model, device, param_dtype="auto"):
    """fully_shard every block and the root, in place (parameters become DTensors on `device`, each rank keeping its
    rows: a model built on the CPU moves only its shards to the GPU); returns the model. param_dtype: the dtype the
    weights are gathered in for compute, with float32 gradient reduction; None keeps float32 throughout; "auto":
    bf16 on GPUs, None on CPU."""
    if param_dtype == "auto":
        param_dtype = torch.bfloat16 if device.type == "cuda" else None
    # lazy: FSDP and DTensor cost ~1.5 s of start-up, paid only by a sharded run (evaluation and serving import this)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    # inputs uncast: the recursion's state stays float32 as under DDP, autocast casts per op
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                                  cast_forward_inputs=False)
    options = dict(mesh=init_device_mesh(device.type, (dist.get_world_size(),)), mp_policy=policy,
                   reshard_after_forward=True)
    for block in model.blocks():
        fully_shard(block, **options)
    if model.config.n_loops:  # a plain block's visit is one block call, FSDP's forward already
        for block in model.transformer.h:
            register_fsdp_forward_method(block, "visit")
    # its own unit: forward_backward's last backward (into the embedding) passes no block, and FSDP reduces a unit's
    # gradient only after a backward that crosses an FSDP unit's output
    # its output in float32, as an fp32 embedding gives it under DDP: the recursion's state must not start in bf16
    fully_shard(model.transformer.wte, **{**options, "mp_policy": MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=policy.reduce_dtype, output_dtype=torch.float32 if param_dtype else None,
        cast_forward_inputs=False)})
    fully_shard(model, **options)
    model.set_reshard_after_backward(False, recurse=False)  # lm_head stays whole across a micro-step's backwards
    register_fsdp_forward_method(model, "forward_backward")
    set_prefetch(model)
    one_iteration_per_micro_step(model)
    return model


def build_sharded_model(config_dict, device, param_dtype="auto"):
    """GPT(GPTConfig.from_dict(config_dict)) sharded (shard_model) before any weight exists: built on the meta device,
    sharded, given this rank's storage on `device`, then initialised from torch's CPU RNG one weight at a time
    (write_rows), so its weights equal those GPT.init_weights gives the unsharded model on the CPU from the same seed,
    and a rank's host memory holds at most one whole weight beyond its shards."""
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict(config_dict))
    shard_model(model, device, param_dtype)
    model.to_empty(device=device)  # FSDP re-pads each rank's shard here (FSDPModule._apply)
    model.init_weights(write=write_rows)  # the rotary buffers too, computed on the device
    return model


@torch.no_grad()
def write_rows(weight, draw):
    """GPT.init_weights' writer for a sharded model: the whole weight drawn on the CPU (every rank draws it alike,
    the RNG stream the unsharded model's init consumes), then this rank's part of it copied into its shard."""
    whole = torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
    draw(whole)
    from torch.distributed.tensor import DTensor  # lazy: as shard_model's
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if not isinstance(weight, DTensor):
        weight.copy_(whole)
        return
    # the rows (Shard(0), uneven counts as torch.chunk splits them, as FSDP pads) this rank holds
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    weight.to_local().copy_(whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))])


def set_prefetch(model):
    """Each unit starts its neighbour's gather as it starts itself: forward, the next layer (the embedding, the
    prelude, the recursion's layers and the coda each in order); backward, the previous one. The unit after the last
    layer differs by step (the coda, the next sweep, the next step after a backward): none there. FSDP's default
    backward prefetch (the unit whose forward ran before, which in the recursion is often a no-gradient sweep's)
    would gather blocks that backward does not need next."""
    t = model.transformer
    prelude, layers, coda = (list(t[name]) if name in t else [] for name in ("prelude", "h", "coda"))
    for chain in ([t.wte, *prelude, *layers], coda):
        for unit, following in zip(chain, chain[1:]):
            unit.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([unit])
    # after the first layer's backward comes the next step's forward (or, at the end, the prelude's backward); after
    # the coda's, the trunk's only when detached (else it runs at the end). Itself (gathered: a no-op) turns FSDP's
    # default off
    layers[0].set_modules_to_backward_prefetch([layers[0]])
    if coda:
        detached_each_step = model.config.detach_between_steps and model.config.backprop_steps == 1
        coda[0].set_modules_to_backward_prefetch([layers[-1] if detached_each_step else coda[0]])


def one_iteration_per_micro_step(model):
    """Wrap model.backward_part (each of forward_backward's backward calls) so that FSDP's iteration spans the
    micro-step: only the last call finalises (waits on pending reductions, drops unused prefetches), and the root,
    which FSDP's end-of-backward callback resets, is kept (its post-forward then ends the iteration)."""
    state, backward_part = model._get_fsdp_state(), model.backward_part  # FSDP2 internals: no public API keeps it
    assert hasattr(state._state_ctx, "iter_forward_root"), "FSDP2's root bookkeeping moved: see sharding.py"

    def kept_root_backward_part(tensors, grads=None, last=False):
        model.set_is_last_backward(last)
        try:
            backward_part(tensors, grads)
        finally:
            model.set_is_last_backward(True)
        state._state_ctx.iter_forward_root = state  # forward_backward (the root's forward) is still running
    model.backward_part = kept_root_backward_part


def on_shards(optimizers):
    """The model's optimizers (built on the sharded parameters) as their sharded forms: AdamW as it is (elementwise,
    on DTensors), Muon as ShardedMuon, with the same groups and learning rates (before the first step: the state
    starts empty)."""
    sharded = []
    for opt in optimizers:
        cls = ShardedMuon if isinstance(opt, Muon) else AdamW
        new = cls.__new__(cls)
        torch.optim.Optimizer.__init__(new, opt.param_groups, opt.defaults)
        sharded.append(new)
    return sharded


# ---------------------------------------------------------------------------------------------------- checkpoints
def checkpoint_state(published, train_model, optimizers):
    """What a sharded checkpoint holds, for torch.distributed.checkpoint (DCP): the published weights ("model"), the
    weights training goes on from when they differ ("train_model"), and every optimizer's per-parameter state
    ("optim", by parameter name: DCP reshards a name's DTensor to any process count). Every rank writes its shards."""
    state = {"model": published.state_dict(), "optim": optimizer_state(train_model or published, optimizers)}
    if train_model is not None:
        state["train_model"] = train_model.state_dict()
    return state


def optimizer_state(model, optimizers):
    """{'<param name>.<state key>': value} over the optimizers, each state created if missing (so a resumed run has
    somewhere to load into; loading overwrites it)."""
    names = {p: name for name, p in model.named_parameters()}
    flat = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state.update(opt.new_state(p))
                flat.update({f"{names[p]}.{key}": value for key, value in state.items()})
    return flat


def load_optimizer_state(model, optimizers, flat):
    """Put optimizer_state's loaded values back (DTensors were loaded in place; plain values are replaced)."""
    names = {p: name for name, p in model.named_parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key in opt.state[p]:
                    opt.state[p][key] = flat[f"{names[p]}.{key}"]
