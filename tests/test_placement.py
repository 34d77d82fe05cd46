"""``FlowModel.device`` / ``dtype`` answer diffusers' values from a cache (``flowalign.models.placement``) that follows
every move and cast of the weights: ``.to()`` a dtype or device, a full fine-tune's fp32 master weights, LoRA, a
swapped transformer, Wan2.2's expert pair; and reads once per change, not once per call."""

import copy

import pytest
import torch

import flowalign.models.placement as placement
from flowalign.models import wrap_pipeline
from flowalign.models.tiny import tiny_sd3_pipeline
from flowalign.models.tiny.wan import tiny_wan22_pipeline

from conftest import WORDS


def diffusers_answer(module):
    """diffusers' own walk, whatever the cache holds."""
    return module.device, module.dtype


def test_the_cache_answers_diffusers_values_and_walks_once_per_change(monkeypatch):
    model = wrap_pipeline(tiny_sd3_pipeline(WORDS, seed=0))
    cls = type(model.transformer)
    walks = []
    for name in ("device", "dtype"):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, property(lambda self, f=original.fget, n=name: walks.append(n) or f(self)))
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float32)
    for _ in range(5):
        assert (model.device, model.dtype) == (torch.device("cpu"), torch.float32)
        model.timestep(0.5, 2)
    assert walks == ["device", "dtype"]  # one walk each, then cached
    model.transformer.to(torch.float64)
    assert model.dtype == torch.float64 and model.device == torch.device("cpu")
    assert walks == ["device", "dtype", "dtype", "device"]  # the cast invalidated both
    assert model.timestep(0.5, 2).dtype == torch.float32  # timesteps stay fp32
    placement.ENABLED = False  # the benchmark's switch: diffusers' walk on every read
    try:
        assert (model.device, model.dtype) == diffusers_answer(model.transformer)
        assert walks[-2:] == ["device", "dtype"]
    finally:
        placement.ENABLED = True


def test_the_cache_follows_device_moves_lora_a_full_fine_tune_and_a_swapped_transformer():
    model = wrap_pipeline(tiny_sd3_pipeline(WORDS, seed=0))
    model.transformer.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    model.make_full_finetune()  # param.data = param.data.float(): the same parameters, another dtype
    assert model.dtype == torch.float32 == diffusers_answer(model.transformer)[1]
    with model.reference():  # the reference copy runs, but device and dtype stay the policy's
        assert (model.device, model.dtype) == diffusers_answer(model.transformer)

    lora = wrap_pipeline(tiny_sd3_pipeline(WORDS, seed=0))
    assert lora.dtype == torch.float32
    lora.add_lora(rank=2)
    assert (lora.device, lora.dtype) == diffusers_answer(lora.transformer)
    lora.transformer.to("meta")  # another device (no storage needed)
    assert lora.device == torch.device("meta") == diffusers_answer(lora.transformer)[0]

    swapped = wrap_pipeline(tiny_sd3_pipeline(WORDS, seed=0))
    assert swapped.dtype == torch.float32
    swapped.pipe.transformer = copy.deepcopy(swapped.pipe.transformer).to(torch.float64)
    assert swapped.dtype == torch.float64


def test_wan22s_expert_pair_answers_the_high_experts_placement():
    model = wrap_pipeline(tiny_wan22_pipeline(WORDS, seed=0))
    assert (model.device, model.dtype) == diffusers_answer(model.pipe.transformer) == (torch.device("cpu"),
                                                                                        torch.float32)
    model.transformer.to(torch.float64)  # both experts
    assert model.dtype == torch.float64


@pytest.mark.parametrize("keep", [["pos_embed"], []])
def test_the_dtype_follows_the_parameter_diffusers_reads_it_from(keep):
    """A transformer that keeps its first module in fp32 answers the first other floating parameter's dtype; casting
    only that parameter's module must invalidate the cache."""
    model = wrap_pipeline(tiny_sd3_pipeline(WORDS, seed=0))
    model.transformer._keep_in_fp32_modules = keep
    assert model.dtype == torch.float32
    for name, module in model.transformer.named_children():
        if name not in keep and any(True for _ in module.parameters()):
            module.to(torch.float64)  # the first module outside the kept ones
            break
    assert model.dtype == diffusers_answer(model.transformer)[1] == torch.float64
