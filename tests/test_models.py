"""Model adapters against the diffusers pipelines they wrap, LoRA through peft, and loading errors."""

import json
import re
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline

from flowalign.models import Cond, SD3Model, load_flow_model, pack_latents, unpack_latents, wrap_pipeline
from flowalign.models.tiny import tiny_flux_pipeline, tiny_sd3_pipeline
from flowalign.samplers import noise_schedule, rollout, sde_step


PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def pipeline_latents(pipe, model, *, steps, size, guidance, seed=0):
    return pipe(
        prompt=PROMPTS,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        height=size[0],
        width=size[1],
        max_sequence_length=model.max_sequence_length,
    ).images


def adapter_ode_latents(model, *, steps, size, guidance, seed=0):
    negatives = [""] * len(PROMPTS) if model.uses_cfg(guidance) else None
    cond = model.encode(PROMPTS, negative_prompts=negatives)
    x = model.prepare_noise(len(PROMPTS), size, generator=torch.Generator().manual_seed(seed))
    out = rollout(model.velocity_fn(cond, guidance), x, model.sigmas(steps, size), torch.zeros(steps))
    return out.final


def test_sd3_dynamic_shift_sigmas_follow_resolution(words):
    pipe = tiny_sd3_pipeline(words)
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, use_dynamic_shifting=True)
    model = wrap_pipeline(pipe)
    assert not torch.equal(model.sigmas(4, 32), model.sigmas(4, 64))
    expected = pipeline_latents(pipe, model, steps=3, size=(32, 32), guidance=1.0)
    assert torch.equal(adapter_ode_latents(model, steps=3, size=(32, 32), guidance=1.0), expected)


def test_flux_sigmas_depend_on_resolution(flux_pipe):
    model = wrap_pipeline(flux_pipe)
    assert not torch.equal(model.sigmas(6, 32), model.sigmas(6, 64))
    assert model.sigmas(6, 32)[0] == 1.0 and model.sigmas(6, 32)[-1] == 0.0


def test_flux_packing_round_trip():
    x = torch.randn(2, 4, 6, 8)
    tokens = pack_latents(x)
    assert tokens.shape == (2, 12, 16)
    assert torch.equal(unpack_latents(tokens, 6, 8), x)
    assert torch.equal(tokens, FluxPipeline._pack_latents(x, 2, 4, 6, 8))


def test_zero_noise_sde_rollout_reproduces_pipeline(sd3_pipe):
    model = wrap_pipeline(sd3_pipe)
    expected = pipeline_latents(sd3_pipe, model, steps=4, size=(32, 32), guidance=1.0)
    x = model.prepare_noise(len(PROMPTS), 32, generator=torch.Generator().manual_seed(0))
    out = rollout(model.velocity_fn(model.encode(PROMPTS), 1.0), x, model.sigmas(4, 32),
                  noise_schedule(0.0).levels(4), kind="flow_grpo", generator=torch.Generator().manual_seed(1))
    assert torch.equal(out.final, expected)
    assert not out.transitions.stochastic.any()


def test_per_sample_sigmas_match_per_row_calls(sd3_pipe):
    model = wrap_pipeline(sd3_pipe)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        batched = model.velocity(x, sigma, cond)
        rows = torch.cat([model.velocity(x[i : i + 1], sigma[i], cond.index([i])) for i in range(2)])
    torch.testing.assert_close(batched, rows, rtol=1e-5, atol=1e-5)


def test_cfg_without_negative_embeddings_is_an_error(sd3_pipe):
    model = wrap_pipeline(sd3_pipe)
    cond = model.encode(PROMPTS)
    with pytest.raises(ValueError, match=r"guidance_scale=3.0 needs negative prompt embeddings"):
        model.velocity(model.prepare_noise(2, 32), 0.5, cond, guidance_scale=3.0)


def test_cond_indexing_and_group_layout():
    cond = Cond(torch.arange(6.0).reshape(3, 2, 1), torch.arange(3.0).reshape(3, 1), text_ids=torch.zeros(2, 3))
    rep = cond.repeat_interleave(2)
    assert len(rep) == 6 and rep.pooled.flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert cond.index(torch.tensor([2, 0])).pooled.flatten().tolist() == [2, 0]
    assert rep.text_ids is cond.text_ids and not cond.has_negative


def test_cond_extras_and_masks_follow_the_rows_and_shared_entries_do_not():
    """Family-specific per-row tensors (masks, condition-image latents) are indexed with the rows; shared ones are
    passed along; without a pooled projection the sentence embedding is the mean over the mask."""
    embeds = torch.tensor([[[1.0], [3.0], [100.0]], [[2.0], [4.0], [6.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    cond = Cond(embeds, mask=mask, extras={"image_latents": torch.tensor([[10.0], [20.0]])},
                shared={"img_shapes": [(1, 2, 2)]})
    rep = cond.repeat_interleave(2).index([3, 0])
    assert rep.extras["image_latents"].flatten().tolist() == [20.0, 10.0]
    assert rep.mask.tolist() == [[1, 1, 1], [1, 1, 0]] and rep.shared is cond.shared
    assert cond.sentence_embedding().flatten().tolist() == [2.0, 4.0]
    assert torch.allclose(Cond(embeds).sentence_embedding().flatten(), torch.tensor([104 / 3, 4.0]))
    pooled = torch.tensor([[7.0], [8.0]])
    assert Cond(embeds, pooled).sentence_embedding() is pooled


def test_trainer_group_layout_shared_noise_log_probs_and_nfe(tmp_path):
    """The trainer's chains (the rollouts training uses): K samples per prompt in prompt order, with
    sampling.shared_noise the K members start from one noise, and the stored log-probs are those of the model."""
    from flowalign.config import load_config
    from flowalign.toy.prompts import split_prompts
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    train, test = split_prompts()
    tiny_sd3_pipeline(sorted({w for e in train + test for w in e["prompt"].split()}), seed=0).save_pretrained(
        tmp_path / "model")
    settings = {"model.path": tmp_path / "model", "model.lora_rank": 4, "reward.rewards": "[{name: brightness}]",
                "data.train_prompts": Path(__file__).resolve().parents[1] / "assets/prompts/train.jsonl",
                "data.prompts_per_iteration": 2, "data.group_size": 3, "sampling.batch_size": 6,
                "sampling.num_steps": 4, "sampling.image_size": 32, "sampling.shared_noise": "true",
                "sampling.window_size": "null", "sampling.window_start": "fixed", "sampling.window_last": "null",
                "train.tracker": "none", "train.eval_at_end": "false", "train.out_dir": tmp_path / "run"}
    trainer = Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in settings.items()]))
    (chunk,) = trainer.rollout(0, trainer.prompts.prompts_for(0))
    t = chunk.rollout.transitions
    x_init = t.x_t[t.step == 0]
    assert torch.equal(x_init[0], x_init[2]) and not torch.equal(x_init[0], x_init[3])
    assert chunk.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and chunk.rollout.nfe == 6 * 4
    assert t.stochastic.tolist() == [s < 3 for s in t.step.tolist()]  # last step is ODE
    assert not torch.equal(chunk.rollout.final[0], chunk.rollout.final[1])  # same start, different SDE noise
    # the stored log-probs are reproduced by re-running the model on the stored transitions
    st = t.select(t.stochastic)
    with torch.no_grad():
        v = trainer.model.velocity(st.x_t, st.sigma, chunk.cond.index(st.prompt_id))
    again = sde_step(st.x_t, v, st.sigma, st.sigma_next, kind=t.kind, noise_level=st.noise_level, prev_sample=st.x_next)
    torch.testing.assert_close(again.log_prob, st.log_prob, rtol=1e-4, atol=1e-4)


def test_cfg_rollouts_count_two_evaluations_per_sample_and_step(sd3_pipe):
    model = wrap_pipeline(sd3_pipe)
    cond = model.encode(PROMPTS, negative_prompts=[""] * len(PROMPTS))
    x = model.prepare_noise(len(PROMPTS), 32, generator=torch.Generator().manual_seed(0))
    out = rollout(model.velocity_fn(cond, 4.0), x, model.sigmas(3, 32), noise_schedule(0.7).levels(3),
                  generator=torch.Generator().manual_seed(1))
    assert out.nfe == 2 * 3 * 2


# --- LoRA ------------------------------------------------------------------------------------------------------


def test_reference_without_lora_is_an_error(sd3_pipe):
    with pytest.raises(RuntimeError, match="call add_lora"):
        with wrap_pipeline(sd3_pipe).reference():
            pass


def test_lora_with_unknown_targets_is_an_error(sd3_pipe):
    with pytest.raises(ValueError, match=r"none of the LoRA target modules \['nonexistent'\]"):
        wrap_pipeline(sd3_pipe).add_lora(rank=4, target_modules=["nonexistent"])


# --- loading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_load_from_local_directory(words, tmp_path, family):
    pipe = tiny_sd3_pipeline(words) if family == "sd3" else tiny_flux_pipeline(words)
    pipe.save_pretrained(tmp_path / "model")
    model = load_flow_model(tmp_path / "model", family=family, dtype="fp32")
    assert model.family == family and model.dtype == torch.float32
    size = (32, 32)
    guidance = 1.0 if family == "sd3" else 3.5
    expected = pipeline_latents(pipe, model, steps=2, size=size, guidance=guidance)
    ours = adapter_ode_latents(model, steps=2, size=size, guidance=guidance)
    assert torch.equal(ours if family == "sd3" else pack_latents(ours), expected)
    bf16 = load_flow_model(tmp_path / "model", dtype="bf16")
    assert bf16.dtype == torch.bfloat16


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"model path '.*no-such-model' does not exist"):
        load_flow_model(missing)
    with pytest.raises(FileNotFoundError, match=r"has no model_index.json"):
        load_flow_model(tmp_path)


def test_unsupported_pipeline_class_is_named(sd3_pipe, tmp_path):
    sd3_pipe.save_pretrained(tmp_path / "model")
    index = tmp_path / "model" / "model_index.json"
    data = json.loads(index.read_text())
    data["_class_name"] = "StableDiffusionXLPipeline"
    index.write_text(json.dumps(data))
    from flowalign.models import MODEL_FAMILIES

    listed = ", ".join(f"{name} ({MODEL_FAMILIES.get(name).pipeline_class_name})" for name in MODEL_FAMILIES)
    assert "flux (FluxPipeline)" in listed and "sd3 (StableDiffusion3Pipeline)" in listed
    with pytest.raises(ValueError, match=r"'StableDiffusionXLPipeline' .* is not one flowalign has an adapter for: the "
                                         r"model families are " + re.escape(listed)):
        load_flow_model(tmp_path / "model")
    with pytest.raises(ValueError, match=r"'dict' .* is not one flowalign has an adapter for"):
        wrap_pipeline({})


def test_family_mismatch_and_bad_dtype(sd3_pipe, tmp_path):
    sd3_pipe.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"is a StableDiffusion3Pipeline, not a 'flux' model"):
        load_flow_model(tmp_path / "model", family="flux")
    with pytest.raises(ValueError, match=r"unknown model family 'flx': known model families are (\w+, )*flux, (\w+, )*"
                                         r"sd3(, \w+)*; did you mean"):
        load_flow_model(tmp_path / "model", family="flx")
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'"):
        load_flow_model(tmp_path / "model", dtype="fp8")


def test_a_pipeline_without_a_lora_loader_gets_the_transformers_own_format_and_says_so(words, tmp_path, caplog):
    """No ``save_lora_weights`` on the pipeline class: the adapter is written in the transformer's format, which
    ``transformer.load_lora_adapter`` reads back to the same velocity, and a warning names the format."""
    from diffusers import StableDiffusion3Pipeline

    class NoLoaderPipeline(StableDiffusion3Pipeline):
        save_lora_weights = None

    def build():
        pipe = tiny_sd3_pipeline(words, seed=0)
        pipe.__class__ = NoLoaderPipeline
        return SD3Model(pipe)

    model = build()
    model.add_lora(rank=4, alpha=8)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model.velocity(x, 0.6, cond)
    with caplog.at_level("WARNING", logger="flowalign.models.base"):
        saved = model.save_lora(tmp_path / "lora")
    assert "NoLoaderPipeline has no LoRA loader" in caplog.text and "load_lora_adapter" in caplog.text
    fresh = build()
    fresh.transformer.load_lora_adapter(str(saved), prefix=None, use_safetensors=True)
    with torch.no_grad():
        loaded = fresh.velocity(x, 0.6, cond)
    torch.testing.assert_close(loaded, adapted, rtol=1e-5, atol=1e-6)
