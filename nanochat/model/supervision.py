"""
The deep-supervision loss and the training head, kept out of the model file as TinyRecursiveModels keeps its loss
head apart (halting.py holds the halting head's loss). gpt.py imports it relatively, so the Hugging Face export
carries it beside gpt.py: it imports only torch.

- The loss over the supervision steps: weights base**s (normalised) plus the improvement reward (deep_supervision_loss)
  and, optionally, a consistency term on each later step's move of the answer (consistency_term),
  what a step's losses report (loss_aux, refinement) and the recursion's state per step (state_diagnostics).
- The head's loss in chunks: the softcapped cross-entropy of lm_head in training (ChunkedHeadLoss, gradients computed
  in forward; as many rows a chunk as the caller gives, by default HEAD_CHUNK_ELEMENTS logits at a time, and the
  whole micro-batch in one chunk where the plan's memory allows it) and in evaluation (chunked_token_losses), never the
  whole (B, T, vocab) float32 logits unless asked. normed_head_chunk_loss_and_grads folds the final norm into the
  chunk, so that a compiled chunk is norm, lm_head, softcap and cross-entropy in one region.
"""

import torch
import torch.nn.functional as F


def supervision_weights(n_sup, base):
    """w_s = base**s / sum_j base**j: later (better) steps weigh more."""
    powers = [base ** s for s in range(n_sup)]
    return [p / sum(powers) for p in powers]


# The reward divides by the previous step's loss, floored here: a solved step's float32 loss is exactly 0 (softcapped
# logits at +-15 put log-sum-exp within rounding of the target's), and 1/0 turned a solved hops run into NaN.
REWARD_LOSS_FLOOR = 0.01


def reward_weight(previous_loss, scale):
    """The improvement reward's weight on a step's loss: scale / max(sg(previous step's loss), REWARD_LOSS_FLOOR)."""
    return scale / previous_loss.detach().clamp(min=REWARD_LOSS_FLOOR)


def deep_supervision_loss(step_losses, base, scale, consistency=None):
    """total = sum_s w_s loss_s - scale * sum_{s>=1} (sg(loss_{s-1}) - loss_s) / max(sg(loss_{s-1}), floor).

    The stop-gradient means a step can never earn reward by making the previous draft worse. Because of it the
    reward acts as an extra weight scale/loss_{s-1} on each later step's loss (reward_weight), which at typical
    losses (~3-10) dominates the base**s weights.
    consistency: per step s >= 1, a term (consistency_term) added to that step's loss, weighed as the loss is.
    """
    weights = supervision_weights(len(step_losses), base)
    total = sum(w * loss for w, loss in zip(weights, step_losses))
    for prev, cur in zip(step_losses[:-1], step_losses[1:]):
        total = total - reward_weight(prev, scale) * (prev.detach() - cur)
    for s, term in enumerate(consistency or [], start=1):
        total = total + (weights[s] + reward_weight(step_losses[s - 1], scale)) * term
    return total


def consistency_term(y, previous, weight):
    """weight x ||y - sg(previous)||^2 / ||sg(previous)||^2 per position, averaged (GPTConfig.consistency_weight): what
    a supervision step pays for moving the answer, so it moves it only as far as its loss gains by it."""
    y, previous = y.float(), previous.detach().float()
    return weight * ((y - previous).square().sum(-1) / previous.square().sum(-1).clamp(min=1e-12)).mean()


def refinement(values):
    """(first - last) / first: the fraction of the first draft's loss that the later steps removed (per-step losses,
    a list or a tensor: no branch on the values, so a tensor's costs no host sync)."""
    return (values[0] - values[-1]) / values[0]


def loss_aux(step_losses):
    return {"step_losses": step_losses, "refinement": refinement(step_losses)}


STATE_DIAGNOSTICS = ("rms_y", "rms_z", "rms_update", "cos_update_y")


@torch.no_grad()
def state_diagnostics(previous_y, y, z):
    """(4,) float32 for one supervision step: RMS of y and of z, RMS of the step's update y - y_prev, and the cosine
    between that update and y_prev. A recursion that settles has a shrinking update; an unbounded one a growing
    RMS of y and an update ever more parallel to y."""
    rms = lambda t: t.float().square().mean().sqrt()
    update = (y - previous_y).float()
    cos = F.cosine_similarity(update.flatten(0, -2), previous_y.float().flatten(0, -2), dim=-1).mean()
    return torch.stack([rms(y), rms(z) if z is not None else torch.zeros((), device=y.device), rms(update), cos])


# ---------------------------------------------------------------------------------------------------- the head's loss
SOFTCAP = 15.0  # logits = SOFTCAP * tanh(lm_head(norm(y)) / SOFTCAP)
# The training loss's default chunk, in logits: a chunk's float32 (rows, vocab) tensors are 1 GB, not the micro-batch's
# tens of GB; 4,096 rows at vocab 65,536. The plan gives fewer, larger chunks (one) where memory allows
# (memory.head_chunks_that_fit): 16 chunks of 4,096 rows were the depth-12 kit's step on one H100.
HEAD_CHUNK_ELEMENTS = 2 ** 28


def default_head_rows(vocab_size):
    """Rows of the default chunk: HEAD_CHUNK_ELEMENTS logits."""
    return max(1, HEAD_CHUNK_ELEMENTS // vocab_size)


def rows_per_chunk(n_rows, chunks, vocab_size):
    """Rows a chunk for n_rows rows in `chunks` equal chunks (None: the default chunk's rows)."""
    return default_head_rows(vocab_size) if not chunks else -(-n_rows // chunks)


def head_chunk_loss_and_grads(h, weight, targets, grad_scale):
    """For rows h (n, C) of norm(y): the summed softcapped cross-entropy (targets -1 ignored) and its gradients with
    respect to h and weight, times grad_scale (a 0-dim tensor: a Python float would be a compile guard)."""
    # in place where a float32 (rows, vocab) tensor is not read again: eager then allocates three, not eight
    logits = F.linear(h, weight)
    t = logits.float().div_(SOFTCAP).tanh_()
    capped = SOFTCAP * t
    lse = torch.logsumexp(capped, dim=-1)
    valid = targets != -1
    picked = targets.clamp(min=0).unsqueeze(1)
    loss = torch.where(valid, lse - capped.gather(1, picked).squeeze(1), 0.0).sum()
    # d loss / d capped = softmax - one-hot; through the softcap d capped / d logits = 1 - t^2
    d_capped = capped.sub_(lse.unsqueeze(1)).exp_().scatter_add_(1, picked, -torch.ones_like(picked, dtype=t.dtype))
    d_logits = d_capped.mul_((valid * grad_scale).unsqueeze(1)).mul_(t.square_().neg_().add_(1)).to(logits.dtype)
    return loss, d_logits @ weight, d_logits.t() @ h


def fusable_head_chunk_loss_and_grads(h, weight, targets, grad_scale):
    """head_chunk_loss_and_grads written without in-place ops, for torch.compile: inductor then reads the
    low-precision logits twice (log-sum-exp, then the gradient) instead of keeping float32 copies; 8.3 bytes a logit
    at its peak under bf16 autocast on CPU inductor against 14.4 for the eager one (dev/LOG.md, 2026-11-28)."""
    logits = F.linear(h, weight)
    t = torch.tanh(logits.float() / SOFTCAP)
    capped = SOFTCAP * t
    lse = torch.logsumexp(capped, dim=-1)
    valid = targets != -1
    picked = targets.clamp(min=0).unsqueeze(1)
    loss = torch.where(valid, lse - capped.gather(1, picked).squeeze(1), 0.0).sum()
    one_hot = torch.arange(capped.size(1), device=h.device) == picked  # a comparison fuses; a scatter would not
    d_capped = torch.exp(capped - lse.unsqueeze(1)) - one_hot.float()
    d_logits = (d_capped * (valid * grad_scale).unsqueeze(1) * (1 - t * t)).to(logits.dtype)
    return loss, d_logits @ weight, d_logits.t() @ h


def normed_head_chunk_loss_and_grads(y, weight, targets, grad_scale, fusable=False):
    """head_chunk_loss_and_grads of norm(y) (gpt.norm: RMSNorm without weight, float32), with the gradient taken
    through the norm to y: compiled (fusable=True), the whole head of a chunk is one region (the eager norm and its
    backward were two passes over the micro-batch's states besides)."""
    y32 = y.float()
    inverse_rms = torch.rsqrt(y32.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
    h = y32 * inverse_rms
    chunk = fusable_head_chunk_loss_and_grads if fusable else head_chunk_loss_and_grads
    loss, grad_h, grad_weight = chunk(h, weight, targets, grad_scale)
    g = grad_h.float()  # d/dy of y * rsqrt(mean(y^2)): (g - h * mean(g h)) * rsqrt(mean(y^2))
    return loss, ((g - h * (g * h).mean(-1, keepdim=True)) * inverse_rms).to(y.dtype), grad_weight


class ChunkedHeadLoss(torch.autograd.Function):
    """Mean softcapped cross-entropy of lm_head over rows h (N, C), `rows` rows a chunk (None: HEAD_CHUNK_ELEMENTS
    logits a chunk).

    Each chunk's gradients are computed in forward, while its logits exist (training backpropagates every head's
    loss at once anyway), so backward only scales them: no (N, vocab) float32 tensor is ever stored or rebuilt.
    chunk_fn is head_chunk_loss_and_grads (h = norm(y)) or normed_head_chunk_loss_and_grads (h = y), or the
    compiled twin of either. One chunk (rows >= N) is a single call: no running sum, no slicing."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_fn, rows=None):
        device = h.device.type  # under autocast: cast lm_head once here, not once per chunk
        lowp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        weight_lowp = weight.to(lowp)
        grad_scale = 1.0 / (targets != -1).sum()  # the mean over the targets that count, as F.cross_entropy
        rows = rows or default_head_rows(weight.size(0))
        if rows >= h.size(0):
            loss, grad_h, grad_weight = chunk_fn(h, weight_lowp, targets, grad_scale)
            ctx.save_for_backward(grad_h, grad_weight.to(weight.dtype))
            return loss * grad_scale
        # float32 sum of the chunks' partials: FSDP's bf16 weight would otherwise round the running sum at every chunk
        loss, grad_h, grad_weight = 0.0, torch.empty_like(h), torch.zeros_like(weight, dtype=torch.float32)
        for i in range(0, h.size(0), rows):
            chunk_loss, grad_h[i:i + rows], chunk_grad_weight = chunk_fn(h[i:i + rows], weight_lowp,
                                                                         targets[i:i + rows], grad_scale)
            loss = loss + chunk_loss
            grad_weight += chunk_grad_weight
        ctx.save_for_backward(grad_h, grad_weight.to(weight.dtype))
        return loss * grad_scale

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_weight = ctx.saved_tensors
        return grad_h * grad_loss, grad_weight * grad_loss, None, None, None


@torch.no_grad()
def chunked_token_losses(head, h, targets, vocab_size):
    """Per-token cross-entropy (targets -1 give 0) of head(h) for rows h (N, C), HEAD_CHUNK_ELEMENTS logits at a
    time (evaluation and the halting head's targets: no gradient)."""
    t = targets.flatten()
    rows = default_head_rows(vocab_size)
    return torch.cat([F.cross_entropy(head(h[i:i + rows]), t[i:i + rows], ignore_index=-1, reduction="none")
                      for i in range(0, h.size(0), rows)]).view(targets.shape)
