"""A released model's BOS policy (`Tokenizer.bos_id`, `encode_prompt`): recorded by the converters from
the release tokenizer, applied wherever a text starts (generate, eval's data, serve's prompts, the
exported Transformers tokenizer); checkpoints without one add nothing."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from looplm import checkpoint as ckpt
from looplm.config import ModelConfig
from looplm.data import BPETokenizer
from looplm.infer.generate import DepthRule, SamplingConfig, generate
from looplm.model import LoopedLM

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

EOS, PAD, BOS = "<|end_text|>", "<|pad|>", "<|begin_text|>"
TEXT = "the recurrent model thinks deeper and deeper, then answers"


def backend(post_processor: bool, specials: tuple[str, ...] = (EOS, PAD, BOS)) -> HFTokenizer:
    """A byte-level BPE trained on TEXT with `specials` as its first ids (in that order)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    if post_processor:  # what Huginn's tokenizer.json does: every encoded text starts with its BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    return tok


def tokenizer(tmp_path, bos: bool) -> BPETokenizer:
    path = tmp_path / "tokenizer.json"
    backend(bos).save(str(path))
    return BPETokenizer.from_file(path, EOS, PAD, BOS if bos else None)


@pytest.fixture(scope="module")
def bos_run(tmp_path_factory):
    """A run folder of a random tiny model whose tokenizer starts every text with BOS, on JSONL text."""
    from _jobs import tiny_job

    root = tmp_path_factory.mktemp("bos")
    tok = tokenizer(root, bos=True)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{TEXT} {i}"}) + "\n" for i in range(200)))
    job = tiny_job(root, "run", data__source=str(corpus))
    job.model.vocab_size = tok.vocab_size
    torch.manual_seed(0)
    ckpt.save_model(root / "run", LoopedLM(job.model), job.to_dict(), tok)
    return root / "run"


def test_the_policy_survives_the_checkpoint(bos_run, tmp_path):
    model, tok, _ = ckpt.load_model(bos_run)
    hf = backend(True)
    assert tok.bos_id == hf.token_to_id(BOS)
    ids = tok.encode(TEXT)
    assert tok.encode_prompt(TEXT) == [tok.bos_id, *ids] == hf.encode(TEXT).ids  # as the release encodes
    plain = tokenizer(tmp_path, bos=False)
    assert plain.bos_id is None and plain.encode_prompt(TEXT) == plain.encode(TEXT) == ids
    assert plain.fingerprint() != tok.fingerprint()  # token caches of the two never mix


def _greedy_recompute(model, ids: list[int], n: int, depth: int, eos: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence natively for every new token (no cache)."""
    out = list(ids)
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([out]), depth, init="seeded").logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
    return out[len(ids) :]


def test_generate_starts_the_prompt_with_bos(bos_run):
    from looplm.infer.prefill import Prefill

    model, tok, _ = ckpt.load_model(bos_run)
    fed = []

    def prefill(m, tokens, *args, **kwargs):  # the teacher prefill, recording what it is fed
        fed.append(tokens.tolist())
        return Prefill()(m, tokens, *args, **kwargs)

    got = generate(
        model,
        tok,
        ["the model"],
        DepthRule(3),
        cache="full",
        sampling=SamplingConfig(max_new_tokens=8),
        prefill=prefill,
    )
    assert fed == [[[tok.bos_id, *tok.encode("the model")]]]
    assert got == [tok.decode(_greedy_recompute(model, fed[0][0], 8, 3, tok.eos_id))]


def test_eval_data_starts_every_document_with_bos(bos_run):
    _, tok, _ = ckpt.load_model(bos_run)
    val = ckpt.load_data(bos_run).validation(tok)
    b = val.get_batch(list(range(len(val))))
    starts = torch.zeros_like(b.doc_ids, dtype=torch.bool)  # where a new document begins inside a row
    starts[:, 1:] = b.doc_ids[:, 1:] != b.doc_ids[:, :-1]
    assert starts.sum() >= 5 and bool((b.inputs[starts] == tok.bos_id).all())
    assert int((b.inputs == tok.bos_id).sum()) == int(starts.sum()) + int((b.inputs[:, 0] == tok.bos_id).sum())
    assert not bool((b.targets == tok.bos_id).any())  # BOS is never scored


def test_serve_encodes_prompts_with_bos(bos_run):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from looplm.serve import Engine, EngineConfig
    from looplm.serve.api import create_app

    model, tok, _ = ckpt.load_model(bos_run)
    engine = Engine(model, tok, EngineConfig(max_batch=2, depth=2))
    with TestClient(create_app(engine, "bos")) as client:
        body = client.post("/v1/completions", json={"model": "bos", "prompt": "the model", "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens"] == len(tok.encode("the model")) + 1


def test_export_writes_the_policy_into_the_transformers_tokenizer(bos_run, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from looplm.hf import export

    _, tok, _ = ckpt.load_model(bos_run)
    out = export(bos_run, tmp_path / "hf")
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXT)["input_ids"] == tok.encode_prompt(TEXT)
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == tok.bos_id
    assert ckpt.load_model(out)[1].bos_id == tok.bos_id  # looplm's commands on the exported folder
    # A checkpoint without a policy: the release tokenizer's own post-processor must not add one either.
    plain = tmp_path / "plain"
    path = tmp_path / "with-template.json"
    backend(True).save(str(path))  # a tokenizer.json that would add BOS, recorded without a policy
    model = LoopedLM(ModelConfig(vocab_size=300, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64))
    from _jobs import tiny_job

    job = tiny_job(tmp_path)
    job.model = model.cfg
    ckpt.save_model(plain, model, job.to_dict(), BPETokenizer.from_file(path, EOS, PAD))
    again = AutoTokenizer.from_pretrained(export(plain, tmp_path / "hf-plain"))
    assert again(TEXT)["input_ids"] == BPETokenizer.from_file(path, EOS, PAD).encode(TEXT)


# -- the policy of a release tokenizer ------------------------------------------------------------
@pytest.mark.parametrize(
    ("post_processor", "config", "want"),
    [
        (True, {}, BOS),  # the tokenizer's own post-processor adds it (Huginn's tokenizer.json)
        (False, {"add_bos_token": True, "bos_token": BOS}, BOS),  # tokenizer_config.json says so
        (False, {"add_bos_token": True, "bos_token": {"content": BOS, "special": True}}, BOS),
        (True, {"add_bos_token": False}, None),  # an explicit no wins
        (False, {"bos_token": BOS}, None),  # a BOS that is named but never added
    ],
)
def test_bos_policy_of_a_release_tokenizer(post_processor, config, want):
    from looplm.data.tokenizer import bos_policy

    assert bos_policy(backend(post_processor), config) == want


def test_a_template_that_also_ends_the_text_still_names_its_bos():
    # "<s> $A </s>" puts the BOS before every text as "<s> $A" does (it was read as no BOS)
    from looplm.data.tokenizer import bos_policy

    tok = backend(False)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))]
    )
    assert bos_policy(tok, {}) == BOS
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, tok.token_to_id(EOS))])
    assert bos_policy(tok, {}) is None  # an end token alone is no BOS


def test_a_policy_naming_an_unknown_token_is_refused():
    from looplm.data.tokenizer import bos_policy
    from looplm.errors import UserError

    with pytest.raises(UserError, match="bos_token '<s>' is not one of its tokens"):
        bos_policy(backend(False), {"add_bos_token": True, "bos_token": "<s>"})


def test_converters_record_the_release_policy(tmp_path):
    """xllm-loop (BOS from the tokenizer's post-processor) and Huginn (add_bos_token in tokenizer_config.json)
    record a BOS; a release tokenizer that adds none (the test artifacts' default) records none."""
    from test_convert_huginn import make_huginn
    from test_convert_xllm_loop import make_release, write_manifest

    from looplm.convert import convert_huginn, convert_xllm_loop

    plain = convert_xllm_loop(make_release(tmp_path / "plain"), tmp_path / "plain-out")
    assert ckpt.load_model(plain)[1].bos_id is None
    src = make_release(tmp_path / "release", manifest=False)
    hf = HFTokenizer.from_file(str(src / "tokenizer" / "tokenizer.json"))
    bos_id = hf.token_to_id("<|bos|>")
    hf.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos_id)])
    hf.save(str(src / "tokenizer" / "tokenizer.json"))
    write_manifest(src)
    out = convert_xllm_loop(src, tmp_path / "out")
    tok = ckpt.load_model(out)[1]
    assert tok.bos_id == bos_id and tok.encode_prompt("the model")[0] == bos_id
    assert json.loads((out / "conversion.json").read_text())["bos_id"] == bos_id

    src = make_huginn(tmp_path / "huginn")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = ckpt.load_model(convert_huginn(src, tmp_path / "huginn-out"))[1]
    assert tok.bos_id == HFTokenizer.from_file(str(src / "tokenizer.json")).token_to_id(config["bos_token"])


def test_a_bos_with_id_zero_is_still_added():
    """A BOS may be the vocabulary's first token (id 0): `encode_prompt` puts it first all the same."""
    bpe = BPETokenizer(backend(False, (BOS, EOS, PAD)), EOS, PAD, BOS)
    assert bpe.bos_id == 0
    assert bpe.encode_prompt(TEXT) == [0, *bpe.encode(TEXT)]


def test_a_bos_beside_looplms_own_special_names_is_kept(tmp_path):
    """A tokenizer with looplm's `<eos>`/`<pad>` and a BOS: saving and loading, and pickling (the
    trainer's broadcast to other ranks), keep the BOS, and its fingerprint differs from the tokenizer
    without one (their token caches never mix)."""
    import pickle

    from looplm.data import load_tokenizer
    from looplm.data.tokenizer import EOS_TOKEN, PAD_TOKEN

    tok = backend(False, (EOS_TOKEN, PAD_TOKEN, BOS))
    with_bos = BPETokenizer(HFTokenizer.from_str(tok.to_str()), bos_token=BOS)
    plain = BPETokenizer(HFTokenizer.from_str(tok.to_str()))
    bos_id = tok.token_to_id(BOS)
    assert with_bos.bos_id == bos_id and plain.bos_id is None
    assert with_bos.fingerprint() != plain.fingerprint()
    with_bos.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.bos_id == bos_id and loaded.fingerprint() == with_bos.fingerprint()
    again = pickle.loads(pickle.dumps(with_bos))
    assert again.bos_id == bos_id and again.encode_prompt(TEXT)[0] == bos_id
    assert again.fingerprint() == with_bos.fingerprint()


def test_bos_policy_reads_the_special_tokens_map():
    """add_bos_token without a bos_token in tokenizer_config.json: the name comes from special_tokens_map.json."""
    from looplm.data.tokenizer import bos_policy

    tok = backend(False)
    assert bos_policy(tok, {"add_bos_token": True}, {"bos_token": BOS}) == BOS
    assert bos_policy(tok, {"add_bos_token": True}, {"bos_token": {"content": BOS}}) == BOS


# -- the exported tokenizer's BOS, special pieces, required names, fingerprints ----------------------------
def test_the_exported_tokenizer_names_its_bos_and_starts_a_pair_with_it_once(bos_run, tmp_path):
    """The exported tokenizer's bos_token is the policy's, and a text pair is one text starting with one BOS."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from looplm.hf import export

    _, tok, _ = ckpt.load_model(bos_run)
    hf_tok = AutoTokenizer.from_pretrained(export(bos_run, tmp_path / "hf"))
    assert (hf_tok.bos_token, hf_tok.bos_token_id) == (BOS, tok.bos_id)
    assert hf_tok(TEXT, "and more")["input_ids"] == [tok.bos_id, *tok.encode(TEXT), *tok.encode("and more")]


def test_token_piece_of_a_special_bos_is_its_name(tmp_path):
    """Any special added token, a BOS included, decodes to nothing, so its piece is its name (a str), not its text as
    bytes."""
    tok = tokenizer(tmp_path, bos=True)
    assert tok.token_piece(tok.bos_id) == BOS
    assert tok.decode([tok.bos_id, *tok.encode("the")]) == "the"


def test_a_bos_the_backend_lacks_is_refused_by_name():
    """A bos_token the tokenizer does not define is a one-line UserError naming it, not a TypeError."""
    from looplm.errors import UserError

    with pytest.raises(UserError, match=r"lacks required special token\(s\) \['<s>'\]"):
        BPETokenizer(backend(False), EOS, PAD, "<s>")


def test_the_fingerprint_tells_the_padding_name_apart():
    """Two wrappers of one tokenizer.json that pad with different tokens pack different rows, so their fingerprints
    (token-cache keys) differ."""
    tok = backend(False)
    a = BPETokenizer(HFTokenizer.from_str(tok.to_str()), EOS, PAD)
    b = BPETokenizer(HFTokenizer.from_str(tok.to_str()), EOS, BOS)
    assert a.pad_id != b.pad_id and a.fingerprint() != b.fingerprint()
    c = BPETokenizer(HFTokenizer.from_str(tok.to_str()), BOS, PAD)
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


def test_tokenizer_config_bos_token_wins_over_the_special_tokens_map():
    """tokenizer_config.json's bos_token is the one transformers adds, the map only fills in a missing one."""
    from looplm.data.tokenizer import bos_policy

    assert bos_policy(backend(False), {"add_bos_token": True, "bos_token": BOS}, {"bos_token": EOS}) == BOS
