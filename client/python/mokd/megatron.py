"""Megatron-Core's MoE layer with its experts run by mokd: the layer's router
stays Megatron's, and the token dispatcher, the experts and the combine (and
the shared expert, where the layer has one) become one mokd.MoELayer call.

    from megatron.core.transformer.moe.moe_layer import MoELayer
    import mokd.megatron
    block.mlp = mokd.megatron.MoELayer(block.mlp)    # block.mlp: a Megatron MoELayer

Written against megatron-core 0.16 (megatron/core/transformer/moe/:
moe_layer.py MoELayer, router.py TopKRouter, experts.py SequentialMLP,
TEGroupedMLP and GroupedMLP, shared_experts.py SharedExpertMLP), which has no
slot for a fused MoE backend: the seam is MoELayer.forward. The router gives
probs and routing_map, both [tokens, E]; the adapter turns them into mokd's
top-k ids and weights (an id of -1 where the router gave a token fewer than
moe_router_topk experts, as token dropping does) and keeps the router's
autograd: the gradient of the weights flows back into probs, and from there
into the router and its auxiliary losses.

The mokd layer's parameters are the source of truth. They are copied from the
Megatron layer's experts once, at construction, and the adapter holds the
router but not the Megatron experts, so an optimizer built over the model
after the swap updates mokd's w_gate, w_up, w_down (s_gate, s_up, s_down).
megatron_state() gives them, or their gradients, back in Megatron's layout
under Megatron's names (for a checkpoint that Megatron loads, or to compare);
copy_to(layer) writes them into a Megatron layer.

Megatron's fc1 of a gated expert is [gate; up] stacked along its outputs
(the first half goes through the activation), fc2 is down:
  SequentialMLP  local_experts.{e}.linear_fc1.weight [2I, H], linear_fc2.weight [H, I]
  TEGroupedMLP   linear_fc1.weight{e} [2I, H], linear_fc2.weight{e} [H, I]
  GroupedMLP     weight1 [H, E*2I], read as [E, H, 2I]; weight2 [E*I, H], read as [E, I, H]
  SharedExpertMLP linear_fc1.weight [2I_s, H], linear_fc2.weight [H, I_s]

Supported: SwiGLU experts (gated_linear_unit, activation_func silu, no clamp
or GLU offset), no biases, no expert, tensor or expert-tensor parallelism (one
process holds every expert), no MoE latent projection, no shared-expert gate,
no probabilities applied on the input, no padding to capacity, no fp8 / fp4.
Anything else raises ValueError naming the setting. megatron is imported only
when an adapter is built, so `import mokd` works without it.
"""

import torch

from . import nn as _nn

__all__ = ["MoELayer", "check_config"]


def _megatron():
    try:
        from megatron.core.transformer.moe import experts, moe_utils
        from megatron.core.utils import get_pg_size
    except ImportError as e:
        raise ImportError("mokd.megatron needs megatron-core (pip install megatron-core): %s"
                          % e) from e
    # megatron-core 0.16 without Transformer Engine leaves te_general_gemm
    # undefined, and its router's gating linear (moe_router_dtype fp32)
    # then fails with a NameError where it asks whether TE is there
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return experts, get_pg_size


def check_config(config):
    """Raises ValueError naming the first setting of a TransformerConfig that
    the adapter does not run."""
    def no(setting, why):
        raise ValueError("mokd.megatron: %s is not supported (%s)" % (setting, why))

    if not config.num_moe_experts:
        no("num_moe_experts=%r" % config.num_moe_experts, "the layer has no routed experts")
    if not config.gated_linear_unit:
        no("gated_linear_unit=False", "mokd runs SwiGLU experts")
    if config.activation_func is not torch.nn.functional.silu:
        no("activation_func=%s" % getattr(config.activation_func, "__name__",
                                          config.activation_func),
           "mokd runs SwiGLU experts: activation_func must be torch.nn.functional.silu")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        no("activation_func_clamp_value=%r" % config.activation_func_clamp_value,
           "mokd's SwiGLU has no clamp of Megatron's kind")
    if getattr(config, "glu_linear_offset", 0.0):
        no("glu_linear_offset=%r" % config.glu_linear_offset, "mokd's SwiGLU has no offset")
    if config.add_bias_linear:
        no("add_bias_linear=True", "mokd's experts have no biases")
    if getattr(config, "moe_latent_size", None):
        no("moe_latent_size=%r" % config.moe_latent_size, "no latent projection in mokd")
    if getattr(config, "moe_shared_expert_gate", False):
        no("moe_shared_expert_gate=True", "mokd's shared expert has no gate")
    if getattr(config, "moe_apply_probs_on_input", False):
        no("moe_apply_probs_on_input=True", "mokd scales each expert's output")
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        no("moe_pad_expert_input_to_capacity=True",
           "padding adds routes beyond moe_router_topk per token")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        no("fp8/fp4", "mokd computes in bf16")


def _check_layer(layer, get_pg_size):
    def no(setting, why):
        raise ValueError("mokd.megatron: %s is not supported (%s)" % (setting, why))

    ep = get_pg_size(layer.ep_group)
    if ep != 1:
        no("expert_model_parallel_size=%d" % ep, "mokd's layer holds every expert; "
           "mokd's own EP groups are in the README")
    if layer.num_local_experts != layer.config.num_moe_experts:
        no("num_local_experts=%d of num_moe_experts=%d" % (layer.num_local_experts,
                                                          layer.config.num_moe_experts),
           "mokd's layer holds every expert")
    tp = get_pg_size(layer.attn_tp_group)
    if tp != 1:
        no("tensor_model_parallel_size=%d" % tp, "every rank would route the same tokens")
    etp = get_pg_size(layer.experts.tp_group)
    if etp != 1:
        no("expert_tensor_parallel_size=%d" % etp, "mokd's experts are not split")


def _experts_kind(experts_mod, ex):
    for cls in (ex.TEGroupedMLP, ex.GroupedMLP, ex.SequentialMLP):
        if isinstance(experts_mod, cls):
            return cls.__name__
    raise ValueError("mokd.megatron: experts module %s is not supported (SequentialMLP, "
                     "TEGroupedMLP and GroupedMLP are)" % type(experts_mod).__name__)


def _read_experts(kind, experts_mod, E, H):
    """fc1 [E, 2I, H] and fc2 [E, H, I] of Megatron's experts."""
    if kind == "SequentialMLP":
        fc1 = torch.stack([m.linear_fc1.weight for m in experts_mod.local_experts])
        fc2 = torch.stack([m.linear_fc2.weight for m in experts_mod.local_experts])
    elif kind == "TEGroupedMLP":
        fc1 = torch.stack([getattr(experts_mod.linear_fc1, "weight%d" % e) for e in range(E)])
        fc2 = torch.stack([getattr(experts_mod.linear_fc2, "weight%d" % e) for e in range(E)])
    else:
        fc1 = experts_mod.weight1.view(E, H, -1).transpose(1, 2)
        fc2 = experts_mod.weight2.view(E, -1, H).transpose(1, 2)
    return fc1, fc2


def _experts_state(kind, E, H, fc1, fc2):
    """Megatron's expert tensors, by name under the MoE layer, from fc1
    [E, 2I, H] and fc2 [E, H, I]."""
    name = {"SequentialMLP": "experts.local_experts.{e}.linear_{fc}.weight",
            "TEGroupedMLP": "experts.linear_{fc}.weight{e}"}.get(kind)
    if name is None:
        return {"experts.weight1": fc1.transpose(1, 2).contiguous().view(H, -1),
                "experts.weight2": fc2.transpose(1, 2).contiguous().view(-1, H)}
    out = {}
    for e in range(E):
        out[name.format(e=e, fc="fc1")] = fc1[e].contiguous()
        out[name.format(e=e, fc="fc2")] = fc2[e].contiguous()
    return out


def _topk(probs, routing_map, K):
    """mokd's routing from Megatron's: ids [T, K] int64 (-1: no route) and
    their probs [T, K], differentiable in probs."""
    chosen, ids = routing_map.to(torch.float32).topk(K, dim=1)
    routed = chosen > 0
    weights = probs.gather(1, ids).masked_fill(~routed, 0.0)
    return ids.masked_fill(~routed, -1), weights


class MoELayer(torch.nn.Module):
    """A Megatron-Core MoELayer whose experts (and shared expert) run in mokd.

    layer: a megatron.core.transformer.moe.moe_layer.MoELayer on the GPU that
    mokd computes on; its router is kept (and shared: it is the same module),
    its experts' weights copied into `moe`, a mokd.nn.MoELayer. forward takes
    and returns what Megatron's MoELayer does: hidden_states [S, B, H] (any
    float dtype; mokd computes in bf16) and optionally padding_mask [B, S],
    and returns (output, None) with output in the input's dtype. socket,
    session and check are mokd.nn.MoELayer's. grad_mode: mokd.nn.MoELayer's;
    None follows the config's gradient_accumulation_fusion ("fp32_accum":
    the expert weights' gradients are added into the main_grad that
    Megatron's DDP attaches to each parameter, as its fused linear layers
    do, grad_added_to_main_grad included).
    """

    def __init__(self, layer, socket=None, session=None, check=False, grad_mode=None):
        super().__init__()
        ex, get_pg_size = _megatron()
        config = layer.config
        check_config(config)
        _check_layer(layer, get_pg_size)
        self.config = config
        self.layer_number = layer.layer_number
        self.router = layer.router
        self.experts_kind = _experts_kind(layer.experts, ex)
        E, H, K = config.num_moe_experts, config.hidden_size, config.moe_router_topk
        with torch.no_grad():
            fc1, fc2 = _read_experts(self.experts_kind, layer.experts, E, H)
            I = fc2.shape[2]
            Is = 0
            if layer.shared_experts is not None:
                s1 = layer.shared_experts.linear_fc1.weight
                s2 = layer.shared_experts.linear_fc2.weight
                Is = s2.shape[1]
            if grad_mode is None:
                grad_mode = "fp32_accum" if getattr(config, "gradient_accumulation_fusion",
                                                    False) else "bf16"
            self.moe = _nn.MoELayer(H, I, E, K, shared_intermediate=Is, socket=socket,
                                    device=fc1.device if fc1.is_cuda else None, check=check,
                                    session=session, grad_mode=grad_mode)
            ws = self.moe.weights()
            ws[0].copy_(fc1[:, :I])
            ws[1].copy_(fc1[:, I:])
            ws[2].copy_(fc2)
            if Is:
                ws[3].copy_(s1[:Is])
                ws[4].copy_(s1[Is:])
                ws[5].copy_(s2)

    def set_layer_number(self, layer_number):
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise ValueError("mokd.megatron: intermediate_tensors (partial CUDA graph capture "
                             "of the MoE layer) is not supported")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()  # as Megatron's MoELayer
        probs, routing_map = self.router(hidden_states, padding_mask)
        ids, weights = _topk(probs, routing_map, self.moe.top_k)
        x = hidden_states.reshape(-1, self.moe.hidden)
        out = self.moe(x, ids, weights)
        return out.view(hidden_states.shape).to(hidden_states.dtype), None

    def megatron_state(self, grads=False):
        """The expert (and shared expert) weights in Megatron's layout, by the
        names they have under a Megatron MoELayer ("experts.weight1",
        "shared_experts.linear_fc1.weight", ...); with grads=True their
        gradients instead (None when a weight has no gradient yet): with
        grad_mode "fp32_accum", the main_grad each adds into (fp32), since the
        .grad Megatron's convention leaves is a placeholder."""
        ws = self.moe.weights()
        if grads:
            fused = self.moe.grad_mode == _nn.GRAD_FP32_ACCUM
            ws = [getattr(w, "main_grad", None) if fused else w.grad for w in ws]
            if any(w is None for w in ws):
                return None
        ws = [w.detach() for w in ws]
        E, H = self.moe.experts, self.moe.hidden
        out = _experts_state(self.experts_kind, E, H, torch.cat(ws[:2], dim=1), ws[2])
        if len(ws) == 6:
            out["shared_experts.linear_fc1.weight"] = torch.cat(ws[3:5], dim=0)
            out["shared_experts.linear_fc2.weight"] = ws[5].contiguous()
        return out

    def copy_to(self, layer):
        """Writes the weights into the experts of a Megatron MoELayer of the
        same configuration (as when saving a checkpoint for Megatron)."""
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for name, w in self.megatron_state().items():
                if name not in params:
                    raise ValueError("mokd.megatron: the Megatron layer has no parameter %s"
                                     % name)
                params[name].copy_(w)
