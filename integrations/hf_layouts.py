"""Transformers model layouts: which weights are stored transposed, which projections are fused, which
3-D parameters are stacked MoE experts (recognised from module types and their configuration).

SWAN whitens a weight in the paper's orientation ``(out, in)``, each fused projection's parts apart
(unless ``split_fused=False``) and each expert of a stack alone. :meth:`TransformersLayouts.prepare`
(called by ``swan_dist.tag_model``, so by ``SWAN(model)``) walks the model once, records on each
recognised module a :class:`~swan_dist.adapter.Form` per parameter, and :meth:`TransformersLayouts.form`
hands it to the classifier; the optimizer then applies it to whatever adapter's pieces hold the
parameter (DDP, FSDP2, FSDP1, DeepSpeed alike). Only layouts checked against the module's own
attributes and configuration are split; any other fused projection is whitened whole, and a 3-D
tensor not recognised stays on the fallback, the summary saying why.

Recognised (transformers 5.x):

- ``transformers.pytorch_utils.Conv1D`` (GPT-2, OpenAI GPT, ImageGPT, Decision Transformer, CLVP):
  stored ``(in, out)``: whitened transposed. ``c_attn`` of their attention (``split(split_size)``):
  Q, K, V (K, V in cross-attention);
- GPT-NeoX, Bloom and Persimmon ``query_key_value`` (``[q k v]`` per head), Falcon ``query_key_value``
  (per head, multi-query, or per KV group), GPT-BigCode ``c_attn`` (per head, or multi-query
  ``[Q; K; V]``), Phi-3 ``qkv_proj``, MPT and DBRX ``Wqkv`` (``[Q; K; V]``); a ``gate_up_proj``
  linear whose module's ``forward`` splits its
  output with ``chunk(2, dim=-1)`` into gate then up (Phi-3, GLM, ...);
- MoE experts declared with Transformers' ``use_experts_implementation`` (Mixtral, Qwen2/3-MoE, OLMoE,
  GPT-OSS, DeepSeek, ...): ``gate_up_proj`` / ``up_proj`` / ``down_proj`` of shape ``(E, ., .)``, stored
  ``(E, out, in)`` or, where the class says ``is_transposed``, ``(E, in, out)``, checked against the
  config's ``hidden_size``; gate, up split per expert (halves with the default gate, alternate rows
  where the class says ``is_concatenated=False``); per-expert biases on the fallback. DBRX's
  ``w1``/``v1``/``w2`` ``(E·I, H)``: E matrices stacked along rows, ``w2`` stored ``(in, out)``.
"""

from __future__ import annotations

import inspect
import re
import sys

from torch import nn

from swan_dist.adapter import Adapter, Form

FORMS = "_swan_forms"  # on a recognised fused projection: {"weight": Form}

_FUSED_NAMES = {"c_attn", "qkv_proj", "query_key_value", "qkv", "Wqkv", "W_pack", "gate_up_proj"}


def _hf_class(module: nn.Module) -> type | None:
    """The module's own Transformers class (FSDP2's ``fully_shard`` subclasses it; skip such wrappers)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls
    return None


def _name(module: nn.Module) -> str:
    cls = _hf_class(module)
    return cls.__name__ if cls is not None else type(module).__name__


def _is_conv1d(module: nn.Module) -> bool:
    cls = _hf_class(module)
    return cls is not None and cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def _linear_out(child: nn.Module) -> int | None:
    """Output features of a linear child (``nn.Linear``: rows of its weight; ``Conv1D``: ``nf``)."""
    if _is_conv1d(child):
        return int(child.nf)
    if isinstance(child, nn.Linear):
        return int(child.out_features)
    return None


def _qkv(parent: nn.Module, child_name: str, out: int) -> tuple[tuple[int, ...], str] | str:
    """(row pattern, parts) of a fused Q/K/V child of an attention module, or why it is not recognised."""
    cls = _name(parent)
    g = lambda key: getattr(parent, key, None)  # noqa: E731
    if cls in ("GPT2Attention", "DecisionTransformerGPT2Attention", "ImageGPTAttention") or (
            cls == "Attention" and _hf_class(parent).__module__.endswith(".openai.modeling_openai")):
        s = g("split_size")
        if child_name == "c_attn" and isinstance(s, int) and out == 3 * s:
            return (s, s, s), "Q, K, V"
        if child_name == "c_attn" and isinstance(s, int) and out == 2 * s and g("is_cross_attention"):
            return (s, s), "K, V (cross-attention)"
        return f"{cls}.{child_name} has {out} outputs, not 3 x split_size ({s})"
    if cls == "GPTNeoXAttention" and child_name == "query_key_value":
        d, h = g("head_size"), getattr(g("config"), "num_attention_heads", None)
        if isinstance(d, int) and isinstance(h, int) and out == 3 * h * d:
            return (d, d, d), f"Q, K, V (per head, {h} heads)"
        return f"{cls}.query_key_value has {out} outputs, not 3 x heads x head_size"
    if cls in ("BloomAttention", "PersimmonAttention") and child_name == "query_key_value":
        d, h = g("head_dim"), g("num_heads")
        if isinstance(d, int) and isinstance(h, int) and out == 3 * h * d:  # view(heads, 3, head_dim)
            return (d, d, d), f"Q, K, V (per head, {h} heads)"
        return f"{cls}.query_key_value has {out} outputs, not 3 x heads x head_dim"
    if cls == "MptAttention" and child_name == "Wqkv":
        e = g("hidden_size")
        if isinstance(e, int) and out == 3 * e:  # chunk(3)
            return (e, e, e), "Q, K, V"
        return f"{cls}.Wqkv has {out} outputs, not 3 x hidden_size"
    if cls == "DbrxAttention" and child_name == "Wqkv":
        e, d, kv = g("hidden_size"), g("head_dim"), g("num_key_value_heads")
        if all(isinstance(x, int) and x > 0 for x in (e, d, kv)) and out == e + 2 * kv * d:
            return (e, kv * d, kv * d), f"Q, K, V ({kv} key/value heads)"
        return f"{cls}.Wqkv has {out} outputs, not hidden_size + 2 x kv heads x head_dim"
    if cls == "Phi3Attention" and child_name == "qkv_proj":
        d, kv, h = g("head_dim"), g("num_key_value_heads"), getattr(g("config"), "num_attention_heads", None)
        if all(isinstance(x, int) and x > 0 for x in (d, kv, h)) and out == (h + 2 * kv) * d:
            return (h * d, kv * d, kv * d), f"Q, K, V ({h} query heads, {kv} key/value heads)"
        return f"{cls}.qkv_proj has {out} outputs, not (heads + 2 kv heads) x head_dim"
    if cls in ("FalconAttention", "FalconFlashAttention2") and child_name == "query_key_value":
        d, h, kv = g("head_dim"), g("num_heads"), g("num_kv_heads")
        if not all(isinstance(x, int) and x > 0 for x in (d, h, kv)):
            return f"{cls} lacks head_dim / num_heads / num_kv_heads"
        if g("new_decoder_architecture"):
            if h % kv == 0 and out == (h + 2 * kv) * d:
                return (h // kv * d, d, d), f"Q, K, V (per key/value group, {kv} groups)"
        elif g("multi_query"):
            if out == (h + 2) * d:
                return (h * d, d, d), "Q, K, V (multi-query)"
        elif out == 3 * h * d:
            return (d, d, d), f"Q, K, V (per head, {h} heads)"
        return f"{cls}.query_key_value has {out} outputs, which its head counts do not explain"
    if cls == "GPTBigCodeAttention" and child_name == "c_attn":
        e, d, h, kvd = g("embed_dim"), g("head_dim"), g("num_heads"), g("kv_dim")
        if g("is_cross_attention"):
            return f"{cls}.c_attn in cross-attention"
        if g("multi_query") and isinstance(e, int) and isinstance(kvd, int) and out == e + 2 * kvd:
            return (e, kvd, kvd), "Q, K, V (multi-query)"
        if not g("multi_query") and isinstance(d, int) and isinstance(h, int) and out == 3 * h * d:
            return (d, d, d), f"Q, K, V (per head, {h} heads)"
        return f"{cls}.c_attn has {out} outputs, which its head counts do not explain"
    return f"{cls}.{child_name}: a fused layout this version does not know"


_GATE_UP = re.compile(r"gate\w*\s*,\s*up\w*\s*=\s*[\w.]+\.chunk\(\s*2\s*,\s*dim\s*=\s*-1\s*\)")


def _gate_up(parent: nn.Module, out: int) -> tuple[tuple[int, ...], str] | str:
    """(row pattern, parts) of a fused gate/up linear, checked in its module's ``forward`` source."""
    try:
        src = inspect.getsource(type(parent).forward)
    except (OSError, TypeError):
        src = ""
    if "gate_up_proj" in src and _GATE_UP.search(src) and out % 2 == 0:
        return (out // 2, out // 2), "gate, up"
    return f"{_name(parent)}.forward does not split gate_up_proj's output as gate, up = .chunk(2, dim=-1)"


def _experts(module: nn.Module, pname: str, shape: tuple[int, ...]) -> Form | None:
    """Stacked MoE experts of a class declared with Transformers' ``use_experts_implementation``."""
    cls = _name(module)
    e = getattr(module, "num_experts", None)
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    if pname.endswith("_bias") and len(shape) == 2:
        return Form(what=f"per-expert biases of {cls}, not a matrix", whiten=False)
    if pname not in ("gate_up_proj", "up_proj", "down_proj") or len(shape) != 3:
        return None
    t = bool(module.is_transposed)
    out, inp = (shape[2], shape[1]) if t else (shape[1], shape[2])
    stored = "stored (E, in, out): whitened per expert, transposed" if t else "stored (E, out, in): whitened per expert"
    want_in = pname != "down_proj"  # gate_up / up read the hidden state, down writes it
    if shape[0] != e or not isinstance(hidden, int) or (inp if want_in else out) != hidden:
        return Form(what=f"3-D {cls}.{pname} {list(shape)} does not match its num_experts={e} and "
                         f"config.hidden_size={hidden} (is_transposed={t}): layout unknown", whiten=False)
    what = f"MoE experts of {cls} (E={e}), {stored}"
    if pname != "gate_up_proj" or not getattr(module, "has_gate", True):
        return Form(transposed=t, what=what, whiten=True)
    from transformers.integrations import moe

    if out % 2:
        return Form(transposed=t, what=f"{what}; gate/up of odd width {out}: whitened whole", whiten=True)
    if not getattr(module, "is_concatenated", True):
        return Form(transposed=t, split=(1, 1), parts="gate, up (interleaved rows)", what=what, whiten=True)
    if getattr(type(module), "_apply_gate", None) is getattr(moe, "_default_apply_gate", object()):
        return Form(transposed=t, split=(out // 2, out // 2), parts="gate, up", what=what, whiten=True)
    return Form(transposed=t, what=f"{what}; its own _apply_gate, so the gate/up split is not known: "
                                   "whitened whole per expert", whiten=True)


def _stored_shape(module: nn.Module) -> tuple[int, int] | None:
    """The full stored shape of a linear module's weight, from its attributes (under FSDP1 the live
    weight may be a flat shard)."""
    if _is_conv1d(module):
        return int(module.nx), int(module.nf)
    if isinstance(module, nn.Linear):
        return int(module.out_features), int(module.in_features)
    return None


def _is_experts(module: nn.Module) -> bool:
    return _hf_class(module) is not None and all(hasattr(module, k)
                                                 for k in ("is_transposed", "num_experts", "has_gate"))


class TransformersLayouts(Adapter):
    """Claims no tensor: recognises Transformers' module layouts (module docstring)."""

    name = "transformers-layouts"

    def claims(self, tensor) -> bool:
        return False

    def prepare(self, model: nn.Module) -> None:
        """Fused projections are recognised from their parent (the attention or MLP module and its
        configuration): recorded on the projection, for :meth:`form`."""
        if "transformers" not in sys.modules:
            return
        for parent in model.modules():
            if _hf_class(parent) is None:
                continue
            for child_name, child in parent.named_children():
                out = _linear_out(child)
                if out is None or child_name not in _FUSED_NAMES:
                    continue
                got = _gate_up(parent, out) if child_name == "gate_up_proj" else _qkv(parent, child_name, out)
                conv = _is_conv1d(child)
                base = "Conv1D weight (in, out): whitened transposed" if conv else ""
                if isinstance(got, str):
                    whole = f"fused projection whitened whole: {got}"
                    form = Form(transposed=conv, what=f"{base}; {whole}" if base else whole)
                else:
                    form = Form(transposed=conv, split=got[0], parts=got[1], what=base)
                object.__setattr__(child, FORMS, {"weight": form})

    def form(self, module: nn.Module, param_name: str, shape: tuple[int, ...]) -> Form | None:
        if _is_experts(module):
            return _experts(module, param_name, shape)
        if _name(module) == "DbrxExpertGLU" and param_name in ("w1", "v1", "w2"):
            e, i, h = (getattr(module, k, None) for k in ("moe_num_experts", "ffn_hidden_size", "hidden_size"))
            if not all(isinstance(x, int) and x > 0 for x in (e, i, h)) or tuple(shape) != (e * i, h):
                return Form(what=f"DbrxExpertGLU.{param_name} {list(shape)} is not (experts x ffn_hidden_size, "
                                 "hidden_size): layout unknown", whiten=False)
            t = param_name == "w2"  # x @ w2: each expert's w2 is stored (in, out)
            how = "(in, out): whitened per expert, transposed" if t else "(out, in): whitened per expert"
            return Form(transposed=t, stack=e, whiten=True,
                        what=f"MoE experts of DbrxExpertGLU (E={e}) stacked along rows, each stored {how}")
        if param_name != "weight" or tuple(shape) != _stored_shape(module):
            return None
        found = (getattr(module, FORMS, None) or {}).get("weight")
        if found is None and _is_conv1d(module):
            found = Form(transposed=True, what="Conv1D weight (in, out): whitened transposed")
        return found
