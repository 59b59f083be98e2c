"""Bad input to every public function: a clear error naming the argument and what was expected.

Only the cases that the loss's own test file does not already hold (``tests/test_kl_div.py``,
``test_fused_linear_cross_entropy.py``, ``test_fused_linear_orpo.py``, ``test_fused_linear_kto.py``,
``test_fused_linear_dpo.py``, ``test_fused_linear_cpo.py``, ``test_fused_linear_grpo.py`` each have a ``bad_inputs`` table): integer/floating confusion for every tensor, each tensor alone
on another device (``meta``), empty tensors, wrong ranks, non-finite, negative or mistyped options,
and the ``nn.Module`` constructors, which validate their options before any call.

Each case: a call, the exception type, and fragments its message must hold (the argument's name
and what was expected).
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels_lib
from kernels_lib import default_device
from kernels_lib.fused_linear_cpo import FusedLinearCPOLoss, FusedLinearSimPOLoss, fused_linear_cpo, fused_linear_simpo
from kernels_lib.fused_linear_dpo import FusedLinearDPOLoss, fused_linear_dpo
from kernels_lib.fused_linear_grpo import FusedLinearGRPOLoss, fused_linear_grpo

DEVICE = default_device()
META = torch.device("meta")


def _tensors():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 6, generator=gen).to(DEVICE)
    w = torch.randn(11, 6, generator=gen).to(DEVICE)
    b = torch.randn(11, generator=gen).to(DEVICE)
    target = torch.randint(0, 11, (4, 3), generator=gen).to(DEVICE)
    return x, w, b, target


# --------------------------------------------------------------------------- KL divergence


def kl_cases():
    x = torch.randn(3, 8, device=DEVICE).log_softmax(-1)
    t = torch.randn(3, 8, device=DEVICE).softmax(-1)
    kl = kernels_lib.kl_div
    return {
        "complex input": (lambda: kl(x.to(torch.complex64), t), TypeError, ["input", "float32", "complex64"]),
        "complex target": (lambda: kl(x, t.to(torch.complex64)), TypeError, ["target", "complex64"]),
        "reduction wrong case": (lambda: kl(x, t, reduction="Sum"), ValueError, ["reduction", "'sum'", "'Sum'"]),
        "empty last dim": (lambda: kl(x[:, :0], t[:, :0]), ValueError, ["input", "empty", "(3, 0)"]),
        "module log_target int": (lambda: kernels_lib.KLDivLoss(log_target=1), TypeError, ["log_target", "bool"]),
        "module reduction None": (lambda: kernels_lib.KLDivLoss(reduction=None), ValueError, ["reduction", "None"]),
    }


# --------------------------------------------------------------------------- cross-entropy


def flce_cases():
    x, w, b, target = _tensors()
    x, target = x[0], target[0]  # (3, 6) rows, (3,) targets
    flce = kernels_lib.fused_linear_cross_entropy

    def call(**change):
        args = dict(x=x, weight=w, target=target, bias=b) | change
        return lambda: flce(**args)

    return {
        "integer x": (call(x=x.long()), TypeError, ["x", "floating", "int64"]),
        "integer weight": (call(weight=w.int()), TypeError, ["weight", "floating", "int32"]),
        "integer bias": (call(bias=b.long()), TypeError, ["bias", "floating", "int64"]),
        "bool target": (call(target=target > 5), TypeError, ["target", "int64 or int32", "bool"]),
        "uint8 target": (call(target=target.to(torch.uint8)), TypeError, ["target", "uint8"]),
        "list target": (call(target=target.tolist()), TypeError, ["target", "torch.Tensor", "list"]),
        "bias from a list": (call(bias=b.tolist()), TypeError, ["bias", "torch.Tensor"]),
        "weight from a list": (call(weight=w.tolist()), TypeError, ["weight", "torch.Tensor"]),
        "fp16 bias with bf16 head": (
            call(x=x.half(), weight=w.half(), bias=b.bfloat16()), TypeError, ["bias", "float16", "bfloat16"],
        ),
        "x on meta": (call(x=x.to(META)), ValueError, ["x on meta", "one device"]),
        "target on meta": (call(target=target.to(META)), ValueError, ["target on meta"]),
        "bias on meta": (call(bias=b.to(META)), ValueError, ["bias on meta"]),
        "empty vocabulary": (call(weight=w[:0], bias=b[:0]), ValueError, ["weight", "empty", "(0, 6)"]),
        "empty hidden": (call(x=x[:, :0], weight=w[:, :0]), ValueError, ["x", "empty"]),
        "weight 3-D": (call(weight=w[None]), ValueError, ["weight", "2 dimension", "(1, 11, 6)"]),
        "bias 2-D": (call(bias=b[None]), ValueError, ["bias", "(V,)", "(1, 11)"]),
        "target with an extra dim": (call(target=target[None]), ValueError, ["target", "x.shape[:-1]", "(1, 3)"]),
        "target far out of range": (call(target=torch.tensor([1, 2, 2**40], device=DEVICE)), ValueError, ["target", "[0, 11)", "1099511627776"]),
        "int32 target below 0": (call(target=torch.tensor([1, -5, 2], dtype=torch.int32, device=DEVICE)), ValueError, ["target", "[0, 11)", "-5"]),
        "reduction None": (lambda: flce(x, w, target, reduction=None), ValueError, ["reduction", "'mean'", "None"]),
        "reduction wrong case": (lambda: flce(x, w, target, reduction="MEAN"), ValueError, ["reduction", "'MEAN'"]),
        "negative chunk_size": (lambda: flce(x, w, target, chunk_size=-1), ValueError, ["chunk_size", "positive int", "-1"]),
        "float chunk_size": (lambda: flce(x, w, target, chunk_size=2.0), ValueError, ["chunk_size", "2.0"]),
        "bool chunk_size": (lambda: flce(x, w, target, chunk_size=True), ValueError, ["chunk_size", "True"]),
        "NaN label_smoothing": (lambda: flce(x, w, target, label_smoothing=math.nan), TypeError, ["label_smoothing", "finite", "nan"]),
        "inf label_smoothing": (lambda: flce(x, w, target, label_smoothing=math.inf), TypeError, ["label_smoothing", "finite", "inf"]),
        "negative label_smoothing": (lambda: flce(x, w, target, label_smoothing=-0.1), ValueError, ["label_smoothing", "[0, 1]"]),
        "str label_smoothing": (lambda: flce(x, w, target, label_smoothing="0.1"), TypeError, ["label_smoothing", "'0.1'"]),
        "inf z_loss_scale": (lambda: flce(x, w, target, z_loss_scale=math.inf), TypeError, ["z_loss_scale", "finite"]),
        "NaN softcap": (lambda: flce(x, w, target, softcap=math.nan), TypeError, ["softcap", "finite"]),
        "inf softcap": (lambda: flce(x, w, target, softcap=math.inf), TypeError, ["softcap", "finite"]),
        "negative softcap": (lambda: flce(x, w, target, softcap=-1.0), ValueError, ["softcap", "> 0"]),
        "bool ignore_index": (lambda: flce(x, w, target, ignore_index=True), TypeError, ["ignore_index", "int"]),
        "module unknown reduction": (lambda: kernels_lib.FusedLinearCrossEntropyLoss(reduction="avg"), ValueError, ["reduction", "'avg'"]),
        "module negative chunk_size": (lambda: kernels_lib.FusedLinearCrossEntropyLoss(chunk_size=-2), ValueError, ["chunk_size", "-2"]),
        "module NaN label_smoothing": (lambda: kernels_lib.FusedLinearCrossEntropyLoss(label_smoothing=math.nan), TypeError, ["label_smoothing", "finite"]),
    }


# --------------------------------------------------------------------------- ORPO


def orpo_cases():
    x, w, b, target = _tensors()
    orpo = kernels_lib.fused_linear_orpo

    def call(**change):
        args = dict(x=x, weight=w, target=target, bias=b) | change
        return lambda: orpo(**args)

    wrong_chosen = target.clone()
    wrong_chosen[1, 2] = 11
    return {
        "integer x": (call(x=x.long()), TypeError, ["x", "floating", "int64"]),
        "x from a list": (call(x=x.tolist()), TypeError, ["x", "torch.Tensor", "list"]),
        "no sequences": (call(x=x[:0], target=target[:0]), ValueError, ["x", "empty", "(0, 3, 6)"]),
        "no tokens": (call(x=x[:, :0], target=target[:, :0]), ValueError, ["x", "empty", "(4, 0, 6)"]),
        "a single sequence": (call(x=x[:1], target=target[:1]), ValueError, ["x", "2n sequences", "odd batch of 1"]),
        "x 4-D": (call(x=x[None], target=target[None]), ValueError, ["x", "3 dimension", "(1, 4, 3, 6)"]),
        "bool target": (call(target=target > 5), TypeError, ["target", "int64 or int32", "bool"]),
        "empty vocabulary": (call(weight=w[:0], bias=None), ValueError, ["weight", "(V, 6)", "(0, 6)"]),
        "weight 1-D": (call(weight=w[0]), ValueError, ["weight", "(V, H)", "(6,)"]),
        "integer bias": (call(bias=b.long()), TypeError, ["bias", "floating", "int64"]),
        "bias from a list": (call(bias=b.tolist()), TypeError, ["bias", "torch.Tensor"]),
        "target on meta": (call(target=target.to(META)), ValueError, ["target on meta"]),
        "weight on meta": (call(weight=w.to(META)), ValueError, ["weight on meta"]),
        "bias on meta": (call(bias=b.to(META)), ValueError, ["bias on meta"]),
        "float nll_target": (call(nll_target=target.float()), TypeError, ["nll_target", "int64 or int32", "float32"]),
        "nll_target from a list": (call(nll_target=target.tolist()), TypeError, ["nll_target", "torch.Tensor"]),
        "nll_target on meta": (call(nll_target=target.to(META)), ValueError, ["nll_target on meta"]),
        "nll_target out of range in the chosen half": (call(nll_target=wrong_chosen), ValueError, ["nll_target", "[0, 11)", "11"]),
        "inf beta": (call(beta=math.inf), TypeError, ["beta", "finite", "inf"]),
        "bool beta": (call(beta=True), TypeError, ["beta", "finite", "True"]),
        "str beta": (call(beta="0.1"), TypeError, ["beta", "'0.1'"]),
        "tensor beta": (call(beta=torch.tensor(0.1)), TypeError, ["beta", "finite real number"]),
        "negative chunk_size": (call(chunk_size=-1), ValueError, ["chunk_size", "positive int"]),
        "int accurate": (call(accurate=1), TypeError, ["accurate", "bool"]),
        "bool ignore_index": (call(ignore_index=False), TypeError, ["ignore_index", "int"]),
        "module NaN beta": (lambda: kernels_lib.FusedLinearORPOLoss(beta=math.nan), TypeError, ["beta", "finite"]),
        "module zero chunk_size": (lambda: kernels_lib.FusedLinearORPOLoss(chunk_size=0), ValueError, ["chunk_size", "positive int"]),
    }


# --------------------------------------------------------------------------- KTO


def kto_cases():
    x, w, b, target = _tensors()
    labels = torch.tensor([True, False, True, False], device=DEVICE)
    kto = kernels_lib.fused_linear_kto
    model = dict(ref_x=x.clone(), ref_weight=w.clone())

    def call(**change):
        args = dict(x=x, weight=w, target=target, preference_labels=labels, bias=b, **model) | change
        return lambda: kto(**args)

    def given_logps(**change):
        return call(**(dict(ref_x=None, ref_weight=None, ref_logps=torch.zeros(4, device=DEVICE)) | change))

    return {
        "integer x": (call(x=x.long()), TypeError, ["x", "floating", "int64"]),
        "x 2-D": (call(x=x[0], target=target[0]), ValueError, ["x", "3 dimension", "(3, 6)"]),
        "no tokens": (call(x=x[:, :0], target=target[:, :0], ref_x=x[:, :0]), ValueError, ["x", "empty", "(4, 0, 6)"]),
        "float target": (call(target=target.float()), TypeError, ["target", "int64 or int32", "float32"]),
        "integer weight": (call(weight=w.long()), TypeError, ["weight", "floating", "int64"]),
        "labels from a list": (call(preference_labels=[True, False, True, False]), TypeError, ["preference_labels", "torch.Tensor", "list"]),
        "float labels": (call(preference_labels=labels.float()), TypeError, ["preference_labels", "bool", "float32"]),
        "labels 2-D": (call(preference_labels=labels[None]), ValueError, ["preference_labels", "(B,)", "(1, 4)"]),
        "labels on meta": (call(preference_labels=labels.to(META)), ValueError, ["preference_labels on meta"]),
        "target on meta": (call(target=target.to(META)), ValueError, ["target on meta"]),
        "weight on meta": (call(weight=w.to(META)), ValueError, ["weight on meta"]),
        "bias on meta": (call(bias=b.to(META)), ValueError, ["bias on meta"]),
        "integer ref_x": (call(ref_x=x.long()), TypeError, ["ref_x", "floating", "int64"]),
        "ref_x from a list": (call(ref_x=x.tolist()), TypeError, ["ref_x", "torch.Tensor"]),
        "ref_x 2-D": (call(ref_x=x[0]), ValueError, ["ref_x", "3 dimension", "(3, 6)"]),
        "ref_x on meta": (call(ref_x=x.to(META), ref_weight=w.to(META)), ValueError, ["ref_x on meta", "ref_weight on meta"]),
        "ref_weight of another vocabulary": (call(ref_weight=w[:5]), ValueError, ["ref_weight", "(11, 6)", "(5, 6)"]),
        "integer ref_bias": (call(ref_bias=b.long()), TypeError, ["ref_bias", "floating", "int64"]),
        "ref_bias on meta": (call(ref_bias=b.to(META)), ValueError, ["ref_bias on meta"]),
        "ref_x without ref_weight": (call(ref_weight=None), ValueError, ["ref_logps", "ref_x and ref_weight"]),
        "ref_bias with ref_logps": (given_logps(ref_bias=b), ValueError, ["ref_logps", "not both"]),
        "ref_logps on meta": (given_logps(ref_logps=torch.zeros(4, device=META)), ValueError, ["ref_logps on meta"]),
        "ref_logps 2-D": (given_logps(ref_logps=torch.zeros(4, 1, device=DEVICE)), ValueError, ["ref_logps", "(B,)", "(4, 1)"]),
        "ref_logps from a list": (given_logps(ref_logps=[0.0] * 4), TypeError, ["ref_logps", "torch.Tensor"]),
        "NaN kl": (call(kl=math.nan), TypeError, ["kl", "finite", "nan"]),
        "inf kl": (call(kl=math.inf), TypeError, ["kl", "finite", "inf"]),
        "bool kl": (call(kl=True), TypeError, ["kl", "finite", "True"]),
        "integer kl tensor": (call(kl=torch.tensor(1, device=DEVICE)), ValueError, ["kl", "floating tensor", "int64"]),
        "kl on meta": (call(kl=torch.tensor(0.1, device=META)), ValueError, ["kl on meta"]),
        "NaN beta": (call(beta=math.nan), TypeError, ["beta", "finite"]),
        "-inf beta": (call(beta=-math.inf), TypeError, ["beta", "finite"]),
        "inf desirable_weight": (call(desirable_weight=math.inf), TypeError, ["desirable_weight", "finite"]),
        "NaN undesirable_weight": (call(undesirable_weight=math.nan), TypeError, ["undesirable_weight", "finite"]),
        "negative chunk_size": (call(chunk_size=-1), ValueError, ["chunk_size", "positive int"]),
        "float ignore_index": (call(ignore_index=-100.0), TypeError, ["ignore_index", "int"]),
        "str accurate": (call(accurate="no"), TypeError, ["accurate", "bool"]),
        "module inf beta": (lambda: kernels_lib.FusedLinearKTOLoss(beta=math.inf), TypeError, ["beta", "finite"]),
        "module int average_log_prob": (lambda: kernels_lib.FusedLinearKTOLoss(average_log_prob=1), TypeError, ["average_log_prob", "bool"]),
        "module negative chunk_size": (lambda: kernels_lib.FusedLinearKTOLoss(chunk_size=-3), ValueError, ["chunk_size", "positive int"]),
    }


# --------------------------------------------------------------------------- DPO


def dpo_cases():
    x, w, b, target = _tensors()
    model = dict(ref_x=x.clone(), ref_weight=w.clone())

    def call(**change):
        args = dict(x=x, weight=w, target=target, bias=b, **model) | change
        return lambda: fused_linear_dpo(**args)

    def given_logps(**change):
        return call(**(dict(ref_x=None, ref_weight=None, ref_logps=torch.zeros(4, device=DEVICE)) | change))

    return {
        "integer x": (call(x=x.long()), TypeError, ["x", "floating", "int64"]),
        "x from a list": (call(x=x.tolist()), TypeError, ["x", "torch.Tensor", "list"]),
        "no tokens": (call(x=x[:, :0], target=target[:, :0], ref_x=x[:, :0]), ValueError, ["x", "empty", "(4, 0, 6)"]),
        "a single sequence": (call(x=x[:1], target=target[:1], ref_x=x[:1]), ValueError, ["x", "2n sequences", "odd batch of 1"]),
        "x 2-D": (call(x=x[0], target=target[0]), ValueError, ["x", "3 dimension", "(3, 6)"]),
        "float target": (call(target=target.float()), TypeError, ["target", "int64 or int32", "float32"]),
        "target out of range": (call(target=target.masked_fill(target == target[1, 1], 11)), ValueError, ["target", "[0, 11)", "11"]),
        "integer weight": (call(weight=w.long()), TypeError, ["weight", "floating", "int64"]),
        "weight of another width": (call(weight=w[:, 1:]), ValueError, ["weight", "(V, 6)", "(11, 5)"]),
        "half bias": (call(bias=b.half()), TypeError, ["bias", "dtype of weight", "float16"]),
        "target on meta": (call(target=target.to(META)), ValueError, ["target on meta"]),
        "bias on meta": (call(bias=b.to(META)), ValueError, ["bias on meta"]),
        "ref_x on meta": (call(ref_x=x.to(META), ref_weight=w.to(META)), ValueError, ["ref_x on meta", "ref_weight on meta"]),
        "integer ref_x": (call(ref_x=x.long()), TypeError, ["ref_x", "floating", "int64"]),
        "ref_weight of another vocabulary": (call(ref_weight=w[:5]), ValueError, ["ref_weight", "(11, 6)", "(5, 6)"]),
        "ref_weight of another dtype": (call(ref_weight=w.half()), TypeError, ["ref_weight", "dtype of ref_x", "float16"]),
        "ref_x without ref_weight": (call(ref_weight=None), ValueError, ["ref_logps", "ref_x and ref_weight"]),
        "ref_logps 2-D": (given_logps(ref_logps=torch.zeros(4, 1, device=DEVICE)), ValueError, ["ref_logps", "(2n,)", "(4, 1)"]),
        "integer ref_logps": (given_logps(ref_logps=torch.zeros(4, dtype=torch.long, device=DEVICE)), TypeError, ["ref_logps", "floating"]),
        "ref_logps on meta": (given_logps(ref_logps=torch.zeros(4, device=META)), ValueError, ["ref_logps on meta"]),
        "ref_logps from a list": (given_logps(ref_logps=[0.0] * 4), TypeError, ["ref_logps", "torch.Tensor"]),
        "NaN beta": (call(beta=math.nan), TypeError, ["beta", "finite", "nan"]),
        "negative beta": (call(beta=-0.1), ValueError, ["beta", "> 0", "-0.1"]),
        "str beta": (call(beta="0.1"), TypeError, ["beta", "'0.1'"]),
        "loss_type None": (call(loss_type=None), TypeError, ["loss_type", "str", "None"]),
        "loss_type wrong case": (call(loss_type="Sigmoid"), ValueError, ["loss_type", "'sigmoid'", "'Sigmoid'"]),
        "aot_unpaired": (call(loss_type=["sigmoid", "aot_unpaired"]), ValueError, ["loss_type", "'aot_unpaired'", "sorts"]),
        "loss_weights a number": (call(loss_weights=1.0), ValueError, ["loss_weights", "list of 1", "1.0"]),
        "bool loss_weights": (call(loss_weights=[True]), TypeError, ["loss_weights", "finite", "True"]),
        "inf label_smoothing": (call(loss_type="robust", label_smoothing=math.inf), TypeError, ["label_smoothing", "finite"]),
        "negative label_smoothing for robust": (call(loss_type="robust", label_smoothing=-0.1), ValueError, ["label_smoothing", "[0, 0.5)", "robust"]),
        "label_smoothing with ipo": (call(loss_type="ipo", label_smoothing=0.1), ValueError, ["label_smoothing", "'ipo'", "use 0.0"]),
        "NaN discopop_tau": (call(discopop_tau=math.nan), TypeError, ["discopop_tau", "finite"]),
        "negative discopop_tau": (call(discopop_tau=-1.0), ValueError, ["discopop_tau", "> 0"]),
        "f_divergence_type None": (call(f_divergence_type=None), ValueError, ["f_divergence_type", "'reverse_kl'", "None"]),
        "js with apo_zero": (call(f_divergence_type="js_divergence", loss_type="apo_zero"), ValueError, ["f_divergence_type", "apo_zero"]),
        "average with sigmoid_norm": (call(average_log_prob=True, loss_type="sigmoid_norm"), ValueError, ["average_log_prob", "sigmoid_norm"]),
        "str average_log_prob": (call(average_log_prob="yes"), TypeError, ["average_log_prob", "bool"]),
        "float ignore_index": (call(ignore_index=-100.0), TypeError, ["ignore_index", "int"]),
        "zero chunk_size": (call(chunk_size=0), ValueError, ["chunk_size", "positive int", "0"]),
        "int accurate": (call(accurate=0), TypeError, ["accurate", "bool"]),
        "module inf beta": (lambda: FusedLinearDPOLoss(beta=math.inf), TypeError, ["beta", "finite"]),
        "module unknown loss_type": (lambda: FusedLinearDPOLoss(loss_type="kto_pair"), ValueError, ["loss_type", "'kto_pair'"]),
        "module label_smoothing with sigmoid": (lambda: FusedLinearDPOLoss(label_smoothing=0.1), ValueError, ["label_smoothing", "'sigmoid'"]),
        "module negative chunk_size": (lambda: FusedLinearDPOLoss(chunk_size=-1), ValueError, ["chunk_size", "positive int"]),
    }


# --------------------------------------------------------------------------- CPO and SimPO


def cpo_cases():
    x, w, b, target = _tensors()

    def call(fn=fused_linear_cpo, **change):
        args = dict(x=x, weight=w, target=target, bias=b) | change
        return lambda: fn(**args)

    wrong_chosen = target.clone()
    wrong_chosen[1, 2] = 11
    return {
        "integer x": (call(x=x.int()), TypeError, ["x", "floating", "int32"]),
        "no sequences": (call(x=x[:0], target=target[:0]), ValueError, ["x", "empty", "(0, 3, 6)"]),
        "a single sequence": (call(fused_linear_simpo, x=x[:1], target=target[:1]), ValueError, ["x", "odd batch of 1"]),
        "x 4-D": (call(x=x[None], target=target[None]), ValueError, ["x", "3 dimension", "(1, 4, 3, 6)"]),
        "bool target": (call(target=target > 5), TypeError, ["target", "int64 or int32", "bool"]),
        "empty vocabulary": (call(weight=w[:0], bias=None), ValueError, ["weight", "(V, 6)", "(0, 6)"]),
        "bias from a list": (call(bias=b.tolist()), TypeError, ["bias", "torch.Tensor"]),
        "weight on meta": (call(weight=w.to(META)), ValueError, ["weight on meta"]),
        "float nll_target": (call(nll_target=target.float()), TypeError, ["nll_target", "int64 or int32", "float32"]),
        "nll_target on meta": (call(nll_target=target.to(META)), ValueError, ["nll_target on meta"]),
        "nll_target out of range in the chosen half": (call(fused_linear_simpo, nll_target=wrong_chosen), ValueError, ["nll_target", "[0, 11)", "11"]),
        "inf beta": (call(beta=math.inf), TypeError, ["beta", "finite", "inf"]),
        "zero beta": (call(fused_linear_simpo, beta=0.0), ValueError, ["beta", "> 0"]),
        "loss_type None": (call(loss_type=None), ValueError, ["loss_type", "'sigmoid'", "None"]),
        "NaN label_smoothing": (call(label_smoothing=math.nan), TypeError, ["label_smoothing", "finite", "nan"]),
        "negative label_smoothing": (call(fused_linear_simpo, label_smoothing=-0.1), ValueError, ["label_smoothing", "[0, 1]"]),
        "label_smoothing with ipo": (call(loss_type="ipo", label_smoothing=0.2), ValueError, ["label_smoothing", "'ipo'", "use 0.0"]),
        "bool cpo_alpha": (call(cpo_alpha=True), TypeError, ["cpo_alpha", "finite", "True"]),
        "NaN simpo_gamma": (call(fused_linear_simpo, simpo_gamma=math.nan), TypeError, ["simpo_gamma", "finite"]),
        "tensor alpha": (call(alpha=torch.tensor(0.1)), TypeError, ["alpha", "finite real number"]),
        "bool ignore_index": (call(ignore_index=True), TypeError, ["ignore_index", "int"]),
        "float chunk_size": (call(fused_linear_simpo, chunk_size=2.0), ValueError, ["chunk_size", "2.0"]),
        "str accurate": (call(accurate="yes"), TypeError, ["accurate", "bool"]),
        "module NaN beta": (lambda: FusedLinearCPOLoss(beta=math.nan), TypeError, ["beta", "finite"]),
        "module alphapo": (lambda: FusedLinearCPOLoss(loss_type="alphapo"), ValueError, ["alphapo", "cpo_alpha=0.0"]),
        "module simpo inf gamma": (lambda: FusedLinearSimPOLoss(simpo_gamma=math.inf), TypeError, ["simpo_gamma", "finite"]),
        "module simpo zero chunk_size": (lambda: FusedLinearSimPOLoss(chunk_size=0), ValueError, ["chunk_size", "positive int"]),
    }


# --------------------------------------------------------------------------- GRPO: TRL 1.16's options


def grpo_cases():
    x, w, b, target = _tensors()
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(4, generator=gen).to(DEVICE)
    old = -torch.rand(4, 3, generator=gen).to(DEVICE)

    def call(fn=fused_linear_grpo, **change):
        args = dict(x=x, weight=w, target=target, bias=b, advantages=adv, old_logps=old) | change
        return lambda: fn(**args)

    return {
        "delta with sapo": (call(loss_type="sapo", delta=1.5), ValueError, ["delta", "'sapo'", "delta=None"]),
        "delta with cispo": (call(loss_type="cispo", delta=1.5), ValueError, ["delta", "'cispo'"]),
        "zero delta": (call(delta=0.0), ValueError, ["delta", "> 0", "0.0"]),
        "str delta": (call(delta="2"), TypeError, ["delta", "None or a finite", "'2'"]),
        "NaN delta": (call(delta=math.nan), TypeError, ["delta", "nan"]),
        "zero sapo_temperature_pos": (call(loss_type="sapo", sapo_temperature_pos=0.0), ValueError, ["sapo_temperature_pos", "> 0"]),
        "inf sapo_temperature_neg": (call(sapo_temperature_neg=math.inf), TypeError, ["sapo_temperature_neg", "finite"]),
        "NaN vespo_k_pos": (call(loss_type="vespo", vespo_k_pos=math.nan), TypeError, ["vespo_k_pos", "finite"]),
        "bool vespo_lambda_neg": (call(vespo_lambda_neg=True), TypeError, ["vespo_lambda_neg", "finite"]),
        "int use_bias_correction_kl": (call(use_bias_correction_kl=1), TypeError, ["use_bias_correction_kl", "bool"]),
        "unknown sampling mode": (call(vllm_importance_sampling_mode="token"), ValueError,
                                  ["vllm_importance_sampling_mode", "'token_truncate'", "'token'"]),
        "clip_min above clip_max": (call(vllm_importance_sampling_clip_min=4.0), ValueError,
                                    ["vllm_importance_sampling_clip_min (4.0)", "less than", "clip_max (3.0)"]),
        "truncate without bounds": (call(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
                                    ValueError, ["vllm_importance_sampling_mode='token_truncate'", "both are None"]),
        "str clip_max": (call(vllm_importance_sampling_clip_max="3"), TypeError, ["vllm_importance_sampling_clip_max", "'3'"]),
        "vespo with a sequence mode": (call(sampler_logps=old, loss_type="vespo"), ValueError,
                                       ["loss_type='vespo'", "vllm_importance_sampling_mode", "'sequence_mask'"]),
        "sampler_logps of the wrong shape": (call(sampler_logps=old[:, :2]), ValueError, ["sampler_logps", "(B, T)", "(4, 2)"]),
        "integer sampler_logps": (call(sampler_logps=old.long()), TypeError, ["sampler_logps", "floating", "int64"]),
        "sampler_logps on meta": (call(sampler_logps=old.to(META)), ValueError, ["sampler_logps on meta"]),
        "sampler_logps from a list": (call(sampler_logps=old.tolist()), TypeError, ["sampler_logps", "torch.Tensor"]),
        "top_entropy_quantile below 1": (call(top_entropy_quantile=0.2), ValueError,
                                         ["top_entropy_quantile=0.2", "chunk by chunk", "1.0"]),
        "top_entropy_quantile above 1": (call(top_entropy_quantile=1.5), ValueError, ["top_entropy_quantile", "[0, 1]"]),
        "num_items_in_batch with sapo": (call(loss_type="sapo", num_items_in_batch=4), ValueError,
                                         ["num_items_in_batch", "'cispo'", "loss_type='sapo'"]),
        "module delta with vespo": (lambda: FusedLinearGRPOLoss(loss_type="vespo", delta=2.0), ValueError, ["delta", "'vespo'"]),
        "module top_entropy_quantile": (lambda: FusedLinearGRPOLoss(top_entropy_quantile=0.5), ValueError, ["top_entropy_quantile"]),
        "module unknown mode": (lambda: FusedLinearGRPOLoss(vllm_importance_sampling_mode=None), ValueError,
                                ["vllm_importance_sampling_mode", "None"]),
    }


CASES = {"kl_div": kl_cases, "fused_linear_cross_entropy": flce_cases, "fused_linear_orpo": orpo_cases, "fused_linear_kto": kto_cases,
         "fused_linear_dpo": dpo_cases, "fused_linear_cpo": cpo_cases, "fused_linear_grpo": grpo_cases}
PARAMS = [pytest.param(loss, case, id=f"{loss}: {case}") for loss, cases in CASES.items() for case in cases()]


@pytest.mark.parametrize("loss, case", PARAMS)
def test_bad_input_raises_naming_the_argument(loss, case):
    call, error, fragments = CASES[loss]()[case]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{missing} not in {type(info.value).__name__}: {message}"
