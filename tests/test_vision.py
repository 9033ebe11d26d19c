"""Vision-language models: images in data, packed forwards, generation with images, the quickstart learns.

A tiny Qwen2-VL-shaped model built from a config (as `recipes/vlm-quickstart.yaml` builds it) reads the
colour pictures of `data/colours` (scripts/make_colour_data.py) and rows written here.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, train_until_crash, write_jsonl

COLOURS = REPO / "data" / "colours"
ARCH = {
    "family": "qwen2_vl",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
    "vision": {"depth": 1, "embed_dim": 32, "num_heads": 2},
}


def vision_tokenizer():
    from arealcli.runtime import vision
    from arealcli.runtime.data.tokenizer import char_tokenizer

    return vision.with_images(char_tokenizer(vision=True), vision.small_image_processor())


@pytest.fixture(scope="module")
def tok():
    return vision_tokenizer()


@pytest.fixture(scope="module")
def module(tok):
    from arealcli.runtime.backends import packing
    from arealcli.runtime.models.model import build_module
    from arealcli.schema.recipe import ModelArchConfig, ModelSpec

    m = build_module(ModelSpec(config=ModelArchConfig(**ARCH)), tok, seed=0).eval()
    packing.set_attention(m, "sdpa")  # as the backends set it: varlen SDPA in the decoder only
    return m


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def mixed_rows(folder: Path) -> Path:
    """Rows with one image, two images (marks), a data: URL, raw text only; of different lengths."""
    images = folder / "pics"
    shutil.copytree(COLOURS / "images", images, dirs_exist_ok=True)
    data_url = "data:image/png;base64," + base64.b64encode((images / "test-0003.png").read_bytes()).decode()
    rows = [
        {"image": "pics/train-0000.png", "prompt": "<image>colour:", "answer": "purple"},
        {
            "image": ["pics/train-0001.png", "pics/train-0002.png"],
            "prompt": "a <image> b <image> same?",
            "answer": "no",
        },
        {"image": data_url, "prompt": "what colour is this shape?", "answer": "orange"},
        {"prompt": "no picture here:", "answer": "ok"},
        {"image": "pics/train-0004.png", "prompt": "<image>c:", "answer": "red"},
    ]
    return write_jsonl(folder / "rows.jsonl", rows)


def dataset(path: Path, tok, **args):
    from arealcli.runtime.data.datasets import PromptAnswerDataset
    from arealcli.schema.components.datasets import PromptAnswerArgs

    return PromptAnswerDataset(PromptAnswerArgs(path=str(path), **args), tok, path.parent)


def test_rows_become_image_tokens_pixels_and_grids(tok, tmp_path):
    ds = dataset(mixed_rows(tmp_path), tok)
    batch = ds.collate(list(range(len(ds))))
    grids = batch.unpack("image_grid_thw")
    assert [g.shape[0] for g in grids] == [1, 2, 1, 0, 1]
    enc = ds.images
    pad = enc.image_token_id
    for ids, grid, pixels in zip(
        batch.unpack("packed_prompts"), grids, batch.unpack("pixel_values"), strict=True
    ):
        # each image: <|vision_start|>, t*h*w / merge^2 placeholders, <|vision_end|>; its patches in pixel_values
        assert int((ids == pad).sum()) == sum(int(g.prod()) // 4 for g in grid)
        assert int((ids == enc.start_token_id).sum()) == grid.shape[0]
        assert pixels.shape[0] == sum(int(g.prod()) for g in grid)
    first = batch.unpack("packed_prompts")[1].tolist()  # "a <image> b <image> same?": marks in place
    text = tok.decode(first)
    assert text.startswith("a <|vision_start|>") and text.endswith("<|vision_end|> same?")
    # a selection of other keys keeps the images with their sequences; so do subsets
    picked = batch.select(["packed_input_ids"]).subset([4, 1])
    assert picked.seqlens["image_grid_thw"] == [1, 2]


def test_chat_rows_with_image_url_parts_read_as_marked_prompts(tok, tmp_path):
    """OpenAI-style messages with image_url parts (a data: URL, a path) give the tokens and pixels of the
    same prompt written with <image> marks; a web URL is refused (nothing is fetched)."""
    import copy

    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    shutil.copy(COLOURS / "images/test-0000.png", tmp_path / "a.png")
    url = data_url(COLOURS / "images/test-0001.png")
    parts = [
        {"type": "image_url", "image_url": {"url": "a.png"}},
        {"type": "text", "text": "then "},
        {"type": "image_url", "image_url": url},
        {"type": "text", "text": "colour:"},
    ]
    chat = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": parts}], "answer": "x"}]
    )
    plain = write_jsonl(
        tmp_path / "plain.jsonl",
        [{"image": ["a.png", url], "prompt": "<image>then <image>colour:", "answer": "x"}],
    )
    a = dataset(chat, chat_tok, messages_key="messages").collate([0])
    b = dataset(plain, chat_tok).collate([0])
    for key in ("packed_prompts", "pixel_values", "image_grid_thw"):
        assert torch.equal(a.data[key], b.data[key]), key

    from arealcli.errors import DataError

    parts[0]["image_url"] = {"url": "https://example.com/a.png"}
    web = write_jsonl(
        tmp_path / "web.jsonl", [{"messages": [{"role": "user", "content": parts}], "answer": "x"}]
    )
    with pytest.raises(DataError, match="not fetched from the web"):
        dataset(web, chat_tok, messages_key="messages")


def test_bad_image_rows_are_named_with_their_line(tok, tmp_path):
    from arealcli.errors import DataError

    (tmp_path / "junk.png").write_bytes(b"not a picture")
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"image": "missing.png", "prompt": "p", "answer": "a"},
            {"image": "junk.png", "prompt": "p", "answer": "a"},
            {"image": "data:image/png;base64,@@@", "prompt": "p", "answer": "a"},
            {"image": 7, "prompt": "p", "answer": "a"},
        ],
    )
    with pytest.raises(DataError) as e:
        dataset(path, tok)
    lines = str(e.value).splitlines()
    assert lines[0].startswith(f"{path}:1:") and "missing.png does not exist" in lines[0]
    assert lines[1].startswith(f"{path}:2:") and "not an image (BMP, GIF, JPEG, PNG" in lines[1]
    assert lines[2].startswith(f"{path}:3:") and "not valid base64" in lines[2]
    assert lines[3].startswith(f"{path}:4:") and "must be a path" in lines[3]

    marks = write_jsonl(
        tmp_path / "marks.jsonl",
        [{"image": str(COLOURS / "images/test-0000.png"), "prompt": "<image><image>", "answer": "a"}],
    )
    with pytest.raises(DataError, match=r"'prompt' has 2 <image> mark\(s\) for 1 image\(s\)"):
        dataset(marks, tok)


def test_check_reads_every_image_before_the_run(tmp_path, cli):
    """`areal check` opens every image of a local JSONL dataset: the training's errors, before it starts
    (without torch: test_recipe_check checks the shipped vlm-quickstart that way)."""
    (tmp_path / "images").mkdir()
    shutil.copy(COLOURS / "images/test-0000.png", tmp_path / "images/ok.png")
    (tmp_path / "images/junk.png").write_bytes(b"not a picture")
    rows = [
        {"image": "images/ok.png", "prompt": "<image>colour:", "answer": "red"},
        {"image": "images/missing.png", "prompt": "<image>colour:", "answer": "red"},
        {"image": "images/junk.png", "prompt": "colour:", "answer": "red"},
        {"image": "images/ok.png", "prompt": "<image><image>colour:", "answer": "red"},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    recipe = yaml.safe_load((REPO / "recipes" / "vlm-quickstart.yaml").read_text())
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["path"] = str(data)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = cli("check", path)
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3  # one file named twice is read once
    assert f"{data}:2: 'image': image images/missing.png does not exist" in errors[0]
    assert f"{data}:3: 'image': not an image" in errors[1]
    assert f"{data}:4: 'prompt' has 2 <image> mark(s) for 1 image(s)" in errors[2]

    recipe["models"]["actor"]["config"].update(family="qwen2", vision=None)
    path.write_text(yaml.safe_dump(recipe))
    result = cli("check", path)
    assert result.exit_code == 2
    assert (
        f"{data}:1: 4 row(s) have images ('image' or image_url parts) but no model of the run"
        in result.stderr
    )

    for row in rows:
        row.update(image="images/ok.png", prompt="<image>colour:")
    write_jsonl(data, rows)
    assert cli("check", path).exit_code == 2  # still a text-only model
    recipe["models"]["actor"]["config"].update(family="qwen2_vl", vision={"depth": 1})
    path.write_text(yaml.safe_dump(recipe))
    result = cli("check", path)
    assert result.exit_code == 0, result.output

    # a backend that cannot give a vision-language model its images (the `images` capability)
    recipe["models"]["actor"]["backend"] = {"type_": "megatron", "args": {"optimizer": {"lr": 1.0e-3}}}
    path.write_text(yaml.safe_dump(recipe))
    result = cli("check", path)
    assert result.exit_code == 2
    assert (
        "model 'actor' reads images, but backend 'megatron' cannot give it images; use fsdp, hf"
        in result.stderr
    )


def test_images_need_a_model_that_reads_them(char_tok, tmp_path):
    from arealcli.errors import DataError

    path = write_jsonl(tmp_path / "rows.jsonl", [{"image": "x.png", "prompt": "p", "answer": "a"}])
    with pytest.raises(DataError, match="no model of the run reads images"):
        dataset(path, char_tok)


def forward_logits(module, mb, layout):
    from arealcli.runtime.backends.hf import run_packed
    from arealcli.runtime.engines.lm_output import as_lm_output

    with torch.no_grad():
        return as_lm_output(run_packed(module, mb, "cpu", layout)).logits


def test_packed_padded_and_transformers_own_forward_agree(module, tok, tmp_path):
    from arealcli.runtime import vision

    ds = dataset(mixed_rows(tmp_path), tok)
    mb = ds.collate(list(range(len(ds))))
    packed, padded = forward_logits(module, mb, "packed"), forward_logits(module, mb, "padded")
    assert torch.allclose(packed, padded, atol=1e-5), (packed - padded).abs().max()
    # each sequence alone through transformers' own path (it computes the M-RoPE positions itself)
    own = []
    for ids, (pixels, grid) in zip(mb.unpack("packed_input_ids"), vision.per_sample_images(mb), strict=True):
        extra = {"pixel_values": pixels, "image_grid_thw": grid} if grid.shape[0] else {}
        with torch.no_grad():
            out = module(
                input_ids=ids[None],
                mm_token_type_ids=(ids == module.config.image_token_id).int()[None],
                use_cache=False,
                **extra,
            )
        own.append(out.logits[0])
    own = torch.cat(own)
    keep = torch.ones(own.shape[1], dtype=torch.bool)
    keep[vision.placeholder_ids(module)] = False  # left out of the policy: generation never writes them
    assert torch.allclose(packed[:, keep], own[:, keep], atol=1e-5)
    assert (packed[:, ~keep] <= vision.EXCLUDED_LOGIT + 100).all()
    # micro-batches of any split carry their own images: the same per-token outputs
    from arealcli.schema.components.engine import MicroBatchSpec

    mbs, _, backward = mb.split(MicroBatchSpec(n_mbs=3))
    assert len(mbs) == 3
    parts = [forward_logits(module, m, "packed") for m in mbs]
    per_sample = [
        p
        for part, m in zip(parts, mbs, strict=True)
        for p in torch.split(part, m.seqlens["packed_input_ids"])
    ]
    assert torch.allclose(torch.cat([per_sample[i] for i in backward]), packed, atol=1e-5)


def test_generation_with_images_matches_the_training_forward(module, tok, tmp_path):
    """The generator's log-probs are the trainer's: the same positions for the image tokens and the text
    after them, left padding or not, and placeholders never sampled."""
    from arealcli.runtime import vision
    from arealcli.runtime.data.sample import SequenceSample
    from arealcli.runtime.generation.sampling import generate
    from arealcli.runtime.interfaces.token_logprobs import next_token_logprobs
    from arealcli.schema.components.engine import GenerationHyperparameters

    ds = dataset(mixed_rows(tmp_path), tok)
    batch = ds.collate(list(range(len(ds))))
    prompts = [p.tolist() for p in batch.unpack("packed_prompts")]
    g = GenerationHyperparameters(max_new_tokens=6, min_new_tokens=6, temperature=1.0)
    torch.manual_seed(0)
    res = generate(module, prompts, g, set(), tok.pad_token_id, "cpu", images=vision.per_sample_images(batch))
    assert all(len(ids) == 6 for ids in res.output_ids)
    assert not any(t in vision.placeholder_ids(module) for ids in res.output_ids for t in ids)
    seqs = SequenceSample.from_lists(
        batch.ids,
        {
            "packed_input_ids": [torch.tensor(p + o) for p, o in zip(prompts, res.output_ids, strict=True)],
            "pixel_values": batch.unpack("pixel_values"),
            "image_grid_thw": batch.unpack("image_grid_thw"),
        },
    )
    from arealcli.runtime.backends.hf import run_packed

    with torch.no_grad():
        logp = next_token_logprobs(run_packed(module, seqs, "cpu"), seqs)
    for i, (lp, p) in enumerate(
        zip(torch.split(logp, seqs.seqlens["packed_input_ids"]), prompts, strict=True)
    ):
        trainer = lp[len(p) - 1 : len(p) + 5]
        assert torch.allclose(trainer, torch.tensor(res.logprobs[i]), atol=1e-4), (
            i,
            trainer,
            res.logprobs[i],
        )


def test_a_tool_may_answer_with_a_picture(module, tok, tmp_path):
    """tool_use episodes with images: every turn generates with the prompt's pictures and those the tools
    returned so far, and the episode carries them all into training: the trainer's log-probs of the
    model's own tokens are the generator's. The model is first fitted to answer `[x]` (a tool call)."""
    import copy

    from arealcli.runtime.backends.hf import HFBackend, run_packed
    from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
    from arealcli.runtime.interfaces.sft import SFTInterface
    from arealcli.runtime.interfaces.token_logprobs import next_token_logprobs
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.runtime.tools import ToolOutput, register_tool
    from arealcli.schema.components.backends import HFBackendArgs
    from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
    from arealcli.schema.components.interfaces import PPOActorArgs, SFTArgs
    from arealcli.schema.registry import TOOLS
    from tests.conftest import train_until

    picture = str(COLOURS / "images/test-0002.png")
    if "show_picture" not in TOOLS.names():
        register_tool("show_picture", lambda arg: ToolOutput("<image>", [picture]))
    workflow = {"type_": "tool_use", "args": {"tools": ["show_picture"], "max_total_tokens": 40}}
    actor = PPOActorInterface(PPOActorArgs.model_validate({"workflow": workflow}))
    m = copy.deepcopy(module)
    model = HFBackend(HFBackendArgs(device="cpu", optimizer={"lr": 3e-3})).initialize(
        Model("actor", m, tok), FinetuneSpec(1000, 1, 1000, 5)
    )
    rows = mixed_rows(tmp_path)
    write_jsonl(rows, [{**json.loads(line), "answer": "[x]"} for line in rows.read_text().splitlines()])
    data = dataset(rows, tok)
    fit = data.collate(list(range(5))).select(["packed_input_ids", "prompt_mask", "loss_mask"])
    sft = SFTInterface(SFTArgs())
    train_until(lambda: sft.train_step(model, fit, MicroBatchSpec()), lambda s: s["loss"] < 0.02, 20, 400)
    batch = data.collate(list(range(5))).repeat_interleave(4)
    torch.manual_seed(0)
    g = GenerationHyperparameters(max_new_tokens=12, temperature=1.0)
    out = actor._generate_episodes(model, batch, g, actor.workflow)

    before = [int(x.shape[0]) for x in batch.unpack("image_grid_thw")]
    after = [int(x.shape[0]) for x in out.unpack("image_grid_thw")]
    assert sum(after) - sum(before) >= 3, (before, after)  # pictures the tool returned
    assert all(a >= b for a, b in zip(after, before, strict=True))
    image_token = m.config.image_token_id
    for ids, grids in zip(out.unpack("packed_input_ids"), out.unpack("image_grid_thw"), strict=True):
        assert int((ids == image_token).sum()) == sum(int(g.prod()) // 4 for g in grids)
    with torch.no_grad():
        logp = next_token_logprobs(run_packed(m, out, "cpu"), out)
    # position t holds log p(token t + 1): the model's own tokens are those whose next one is in the mask
    own = torch.cat([torch.cat([mask[1:].bool(), torch.tensor([False])]) for mask in out.unpack("loss_mask")])
    assert own.sum() > 0
    generated = out.data["packed_logprobs"]
    assert torch.allclose(logp[own.bool()], generated[own.bool()], atol=1e-4)


# --------------------------------------------------------------------------- serving


def test_areal_serve_answers_chat_and_generate_with_images(module, tok, tmp_path):
    """`areal serve` on a saved vision-language model: an OpenAI chat request with an image_url part (the
    `openai` client) and /generate with image_data give the in-process model's greedy tokens and log-probs;
    a weight update that changes only the vision tower changes what it answers as in process; images
    come in the request only."""
    import copy

    from arealcli.runtime import vision
    from arealcli.runtime.clients import launcher
    from arealcli.runtime.generation.sampling import generate
    from arealcli.schema.components.engine import GenerationHyperparameters
    from tests.test_server import post, start_servers

    openai = pytest.importorskip("openai")
    served_tok = copy.deepcopy(tok)
    served_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt as is
    model_dir = tmp_path / "model"
    module.save_pretrained(model_dir)
    vision.save_tokenizer(served_tok, model_dir)
    assert (model_dir / "preprocessor_config.json").is_file()
    picture = COLOURS / "images/test-0001.png"
    encoder = vision.encoder_of(tok)
    pixels, grids = encoder.encode([vision.open_image(str(picture), COLOURS)])
    prompt = encoder.tokenize(tok, "<image>colour:", grids)
    g = GenerationHyperparameters(max_new_tokens=6, min_new_tokens=6, greedy=True)

    def own(m) -> tuple[list[int], list[float]]:
        res = generate(m, [prompt], g, {tok.eos_token_id}, tok.pad_token_id, "cpu", images=[(pixels, grids)])
        return res.output_ids[0], res.logprobs[0]

    ids, lps = own(module)
    servers = start_servers(model_dir, tmp_path / "logs")
    try:
        server = servers[0]
        client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0)
        content = [
            {"type": "image_url", "image_url": {"url": data_url(picture)}},
            {"type": "text", "text": "colour:"},
        ]

        def chat():
            return client.chat.completions.create(
                model=str(model_dir),
                messages=[{"role": "user", "content": content}],
                max_tokens=6,
                temperature=0,
                logprobs=True,
                extra_body={"min_tokens": 6},
            )

        out = chat()
        assert out.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(prompt)
        served_lps = [t.logprob for t in out.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(served_lps, lps, strict=True)) < 1e-4

        bare = base64.b64encode(picture.read_bytes()).decode()
        one_pad = tok.encode(vision.OWN_IMAGE_TEXT + "colour:", add_special_tokens=False)
        for body in (
            {"input_ids": one_pad, "image_data": bare},  # one <|image_pad|> per image, expanded
            {"input_ids": prompt, "image_data": [data_url(picture)]},  # already expanded
            {
                "text": vision.OWN_IMAGE_TEXT + "colour:",
                "image_data": bare,
            },  # as Qwen2-VL's template writes it
        ):
            r = post(
                server,
                "/generate",
                {
                    **body,
                    "sampling_params": {"max_new_tokens": 6, "min_new_tokens": 6, "temperature": 0},
                    "return_logprob": True,
                },
            )
            assert r.status_code == 200, r.text
            got = r.json()["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in got] == ids
            assert max(abs(a - b) for (a, _, _), b in zip(got, lps, strict=True)) < 1e-4

        for image, why in (
            ("https://example.com/a.png", "fetches no URLs"),
            (str(picture), "fetches no URLs"),  # a path on the server's disk is not read either
            (base64.b64encode(b"not a picture").decode(), "not an image"),
        ):
            r = post(server, "/generate", {"text": "<image>colour:", "image_data": image})
            assert r.status_code == 400 and why in r.text, r.text
        r = post(server, "/generate", {"text": "<image><image>colour:", "image_data": bare})
        assert r.status_code == 400 and "2 <image> marks for 1 images" in r.text

        # new weights that differ in the vision tower only: the server answers as the new model does
        changed = copy.deepcopy(module)
        with torch.no_grad():
            for name, p in changed.named_parameters():
                if "visual" in name:
                    p.add_(torch.randn_like(p) * 0.5)
        new_ids, new_lps = own(changed)
        assert new_lps != lps
        changed.save_pretrained(tmp_path / "new")
        r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "new")})
        assert r.status_code == 200 and r.json()["success"], r.text
        out = chat()
        served_lps = [t.logprob for t in out.choices[0].logprobs.content]
        assert max(abs(a - b) for a, b in zip(served_lps, new_lps, strict=True)) < 1e-4
    finally:
        launcher.stop(servers)


# --------------------------------------------------------------------------- runs


def vlm_recipe(tmp_path: Path, name: str = "vlm", backend: str = "hf", **trainer) -> Path:
    """The shipped quickstart, pointing at the shipped data, shortened: 3 SFT steps, then GRPO, 8 prompts
    a step, no samples written."""
    recipe = yaml.safe_load((REPO / "recipes" / "vlm-quickstart.yaml").read_text())
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["path"] = str(COLOURS / Path(recipe[key]["args"]["path"]).name)
    recipe["eval_dataset"]["args"]["limit"] = 24
    recipe["dataflow"]["sft_warmup_steps"] = 3
    recipe["dataset"]["batch_size"] = 8
    recipe["models"]["actor"]["backend"]["type_"] = backend
    recipe["trainer"].update(eval_at_start=False, samples_every_n_steps=100, **trainer)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_sft_and_grpo_with_images_resume_exactly(tmp_path, cli):
    from safetensors.torch import load_file

    from arealcli.runtime.run import checkpoint as ckpt

    # 3 SFT steps, then GRPO; a checkpoint at step 4 (RL), crash during step 5, resume to 6
    recipe = vlm_recipe(tmp_path, max_steps=6, save_every_n_steps=2, eval_every_n_steps=3)
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    result = cli("train", recipe, "-o", full)
    assert result.exit_code == 0, result.output
    train_until_crash(recipe, crashed, step=5)
    assert ckpt.latest_checkpoint(crashed / "checkpoints").name == "step_00000004"
    result = cli("train", recipe, "-o", crashed, "--resume")
    assert result.exit_code == 0, result.output

    def weights(run):
        return load_file(str(run / "checkpoints" / ckpt.step_dir_name(6) / "actor" / "model.safetensors"))

    a, b = weights(full), weights(crashed)
    assert a.keys() == b.keys() and any(k.startswith("visual.") for k in a)  # the names other tools read
    assert all(torch.equal(a[k], b[k]) for k in a)

    def logged(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r.get("sft_warmup/loss"), r.get("actor_train/reward")) for r in rows}

    assert logged(full) == logged(crashed)
    assert logged(full)[6][1] is not None  # the last steps were GRPO steps


@pytest.mark.slow
def test_fsdp_over_two_processes_trains_with_images_as_hf_does(tmp_path):
    """The quickstart's SFT steps on fsdp over 2 processes: the losses and weights of hf in one process
    (the same global batch); its GRPO steps generate with the images on each rank."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from arealcli.runtime.run import checkpoint as ckpt

    runs = {}
    for name, type_, nproc in (("hf1", "hf", 1), ("fsdp2", "fsdp", 2)):
        path = vlm_recipe(
            tmp_path,
            name,
            type_,
            log_every_n_steps=1,
            max_steps=5,
            save_every_n_steps=3,
            eval_every_n_steps=100,
        )
        run = tmp_path / name
        cmd = [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(run)]
        result = subprocess.run(
            [*cmd, "--nproc-per-node", str(nproc)], capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stdout + result.stderr
        runs[name] = run

    def logged(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    ref, got = logged(runs["hf1"]), logged(runs["fsdp2"])
    for a, b in zip(ref[:3], got[:3], strict=True):
        assert b["sft_warmup/loss"] == pytest.approx(a["sft_warmup/loss"], abs=1e-4)
    assert all("actor_train/reward" in r for r in got[3:5])  # GRPO steps ran, generating with images
    a, b = (
        load_file(str(r / "checkpoints" / ckpt.step_dir_name(3) / "actor" / "model.safetensors"))
        for r in runs.values()
    )
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=0, msg=k)


@pytest.mark.slow
def test_the_vlm_quickstart_learns_colours(tmp_path, cli):
    from tests.test_quickstart import eval_accuracy, train

    run_dir = tmp_path / "run"
    train("vlm-quickstart.yaml", run_dir, "trainer.samples_every_n_steps=1000")
    acc = eval_accuracy(run_dir)
    print(f"vlm-quickstart: held-out accuracy {acc}")
    warm, final = acc[40], acc[max(acc)]
    assert acc[0] < 0.3  # six colours: chance is 1/6, and the untrained model writes no colour at all
    assert final >= 0.8 and final >= warm + 0.1, acc

    # `areal eval` reads the image column of the held-out file and agrees with the run's own evaluation
    out = tmp_path / "eval.json"
    result = cli("eval", run_dir, "--data", COLOURS / "test.jsonl", "--n", 1, "-o", out)
    assert result.exit_code == 0, result.output
    assert (
        abs(json.loads(out.read_text())["metrics"]["greedy_accuracy"] - final) <= 0.02
    )  # batch shapes differ

    # `areal chat --image` answers with the colour of the picture
    from tests.test_chat import chat

    rows = [json.loads(line) for line in (COLOURS / "test.jsonl").read_text().splitlines()[:6]]
    right = 0
    for row in rows:
        result = chat(run_dir, "--image", COLOURS / row["image"], "--temperature", "0", input="colour:\n")
        assert result.exit_code == 0, result.output
        right += result.stdout.strip() == row["answer"]
    assert right >= 4, right
