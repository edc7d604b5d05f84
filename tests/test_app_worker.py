"""app.serving.worker: one thread owns the engine; cancel, queueing, errors and model loading."""
from __future__ import annotations

import gc

import pytest
import test_app_support as support
import torch

from engine.core.settings import DecodeSettings
from app.serving.jobs import GenerationRequest
from app.serving.pair import make_engine, validate_model_id
from app.serving.worker import Worker
from engine.errors import ModelLoadError
from engine.models.prompts import encode_chat
from engine.trees.tree import Tree
from engine.tuning.tree_store import build_tree

TREE = build_tree(8, 4)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    yield from support.one_torch_thread()


@pytest.fixture(scope="module")
def pair():
    tokenizer = support.tokenizer()
    target, draft = support.tiny_pair()
    return target, draft, tokenizer


@pytest.fixture()
def worker(pair):
    target, draft, tokenizer = pair
    engine = support.SlowEngine(make_engine(target, draft, tokenizer))
    w = Worker(engine, tokenizer, {"target": "tiny-target", "draft": "tiny-draft"})
    yield w
    w.close()


def prompt(pair, text="Write a haiku about trees"):
    return encode_chat(pair[2], [{"role": "user", "content": text}])


def reference(pair, ids, **kwargs):
    engine = make_engine(pair[0], pair[1], pair[2])
    return engine.generate(ids, **kwargs).tokens


def tokens_of(events, phase="main"):
    return [t for e in events if e.kind == "step" and e.phase == phase for t in e.data.committed]


def test_greedy_answer_equals_the_engine_alone(worker, pair):
    ids = prompt(pair)
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=40, tree=TREE))).wait(60)
    assert events[-1].kind == "done"
    kinds = [e.kind for e in events]
    first_step = kinds.index("step")
    assert kinds[0] == "started" and kinds[1:first_step] == ["prefill"] * (first_step - 1) and first_step > 1
    assert events[first_step - 1].data.fraction == 1.0 and events[first_step - 1].data.done == len(ids) - 1
    assert tokens_of(events) == reference(pair, ids, max_new_tokens=40, tree=TREE)
    assert events[-1].data["main"]["tokens"] == 40


def test_cancel_stops_within_one_step_and_the_next_request_works(worker, pair):
    worker.engine.delay = 0.05
    job = worker.submit(GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=2000, tree=TREE)))
    steps_before = 0
    for event in job.iter_events(timeout=30):
        if event.kind == "step":
            steps_before += 1
            if steps_before == 3:
                break
    job.cancel()
    rest = job.wait(10)
    assert rest[-1].kind == "cancelled"
    assert sum(e.kind == "step" for e in rest) <= 1  # the step in flight when Stop came, at most
    worker.engine.delay = 0.0
    ids = prompt(pair, "Another question")
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=20, tree=TREE))).wait(60)
    assert events[-1].kind == "done"
    assert tokens_of(events) == reference(pair, ids, max_new_tokens=20, tree=TREE)


def test_two_concurrent_requests_queue_and_both_complete_correctly(worker, pair):
    worker.engine.delay = 0.01
    a, b = prompt(pair, "First prompt"), prompt(pair, "Second, different prompt")
    jobs = support.run_in_threads([
        lambda: worker.submit(GenerationRequest(a, settings=DecodeSettings(max_new_tokens=30, tree=TREE)), session="tab-a"),
        lambda: worker.submit(GenerationRequest(b, settings=DecodeSettings(max_new_tokens=30, tree=Tree.chain(3))), session="tab-b")])
    positions = sorted(j.position() for j in jobs)
    assert positions == [0, 1] or positions[1] is None  # one runs, the other waits its turn
    results = support.run_in_threads([lambda: jobs[0].wait(60), lambda: jobs[1].wait(60)])
    assert results[0][-1].kind == results[1][-1].kind == "done"
    queued = [e for r in results for e in r if e.kind == "queued"]
    assert queued and queued[0].data == 1
    assert tokens_of(results[0]) == reference(pair, a, max_new_tokens=30, tree=TREE)
    assert tokens_of(results[1]) == reference(pair, b, max_new_tokens=30, tree=Tree.chain(3))


def test_a_job_cancelled_while_waiting_never_runs(worker, pair):
    worker.engine.delay = 0.05
    first = worker.submit(GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=2000, tree=TREE)), session="x")
    second = worker.submit(GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=10, tree=TREE)), session="y")
    assert second.position() == 1
    second.cancel()
    assert [e.kind for e in second.wait(5)] == ["queued", "cancelled"]
    assert worker.cancel_session("x") == 1
    assert first.wait(10)[-1].kind == "cancelled"
    assert worker.busy == 0 or support.wait_until(lambda: worker.busy == 0, 5)


def test_engine_error_becomes_an_error_event_and_the_worker_keeps_serving(worker, pair):
    worker.engine.fail_after = 2
    events = worker.submit(GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=50, tree=TREE))).wait(30)
    assert events[-1].kind == "error"
    assert "simulated engine failure" in events[-1].data
    assert sum(e.kind == "step" for e in events) == 2
    bad = worker.submit(GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=0, tree=TREE))).wait(10)
    assert bad[-1].kind == "error" and "max_new_tokens" in bad[-1].data
    ids = prompt(pair, "Still there?")
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=12, tree=TREE))).wait(60)
    assert events[-1].kind == "done"
    assert tokens_of(events) == reference(pair, ids, max_new_tokens=12, tree=TREE)


def test_compare_mode_decodes_again_with_the_target_alone(worker, pair):
    ids = prompt(pair)
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=16, tree=TREE), compare=True)).wait(60)
    done = events[-1]
    assert done.kind == "done" and done.data["compare"]["tokens"] == 16
    assert tokens_of(events, "compare") == tokens_of(events, "main")  # greedy: identical answers
    assert all(e.data.tree_size == 1 for e in events if e.kind == "step" and e.phase == "compare")
    assert done.data["baseline_tokens_per_s"] > 0 and worker.baseline_tokens_per_s > 0


def test_the_main_phase_gives_every_nth_step_to_the_target_alone_and_compare_none(worker, pair):
    ids = prompt(pair)
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=24, tree=TREE), compare=True, time_alone_every=4)).wait(60)
    assert events[-1].kind == "done"
    main = [e.data for e in events if e.kind == "step" and e.phase == "main"]
    assert [s.index for s in main if s.timed_alone] == [i for i in range(len(main)) if i % 4 == 1]
    assert not any(e.data.timed_alone for e in events if e.kind == "step" and e.phase == "compare")
    assert tokens_of(events) == reference(pair, ids, max_new_tokens=24, tree=TREE)


def test_failed_model_load_keeps_the_previous_pair(worker, pair, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = (worker.engine, dict(worker.info))
    events = worker.load_models("sequoia-test-org/no-such-model-anywhere", "sequoia-test-org/no-such-draft").wait(60)
    assert events[-1].kind == "error"
    assert "no-such-model-anywhere" in events[-1].data
    assert any(e.kind == "progress" for e in events)
    bad = worker.load_models("not a model id!", "x").wait(10)
    assert bad[-1].kind == "error" and "nor a Hugging Face id" in bad[-1].data
    assert (worker.engine, worker.info) == before and worker.pair_version == 0
    ids = prompt(pair)
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=8, tree=TREE))).wait(60)
    assert tokens_of(events) == reference(pair, ids, max_new_tokens=8, tree=TREE)


def test_model_load_swaps_the_pair_with_an_injected_loader(pair):
    target, draft, tokenizer = pair
    calls = []

    def loader(model_id, dtype, device, trust_remote_code, draft_format="none"):
        calls.append((model_id, draft_format))
        return (target if model_id == "org/target" else draft), tokenizer

    w = Worker.from_models(target, draft, tokenizer, "a", "b", loader=loader)
    try:
        events = w.load_models("org/target", "org/draft").wait(30)
        assert events[-1].kind == "done", events[-1]
        assert calls == [("org/target", "none"), ("org/draft", "auto")]  # only the draft is quantised
        assert w.info["target"] == "org/target" and w.pair_version == 1
    finally:
        w.close()


@pytest.mark.parametrize("value, ok", [("Qwen/Qwen2.5-0.5B-Instruct", True), ("gpt2", True),
                                       ("default-target", True), ("", False), ("a b", False),
                                       ("../no/such/dir", False), ("x" * 400, False), ("../../etc", False),
                                       ("/etc", False), ("~/.ssh", False), ("https://example.com/m", False),
                                       ("file:///etc/passwd", False), ("org/../../etc", False)])
def test_validate_model_id(value, ok):
    if ok:
        assert validate_model_id(value, "target") == value
    else:
        with pytest.raises(ModelLoadError):
            validate_model_id(value, "target")


def test_local_models_only_from_the_models_folder(tmp_path):
    """Folders under the configured models folder load (by name or full path); folders elsewhere,
    ``..`` escapes and symlinks pointing out of it are refused."""
    models, outside = tmp_path / "models", tmp_path / "outside"
    (models / "org" / "mine").mkdir(parents=True)
    outside.mkdir()
    (models / "escape").symlink_to(outside, target_is_directory=True)
    assert validate_model_id("org/mine", "target", models) == str((models / "org" / "mine").resolve())
    assert validate_model_id(str(models / "org" / "mine"), "target", models) == str((models / "org" / "mine").resolve())
    for value in (str(outside), "../outside", "escape", "org/mine/../../../outside", str(models)):
        with pytest.raises(ModelLoadError, match="not a folder in the models folder|neither"):
            validate_model_id(value, "target", models)
    assert validate_model_id("Qwen/Qwen2.5-0.5B-Instruct", "target", models) == "Qwen/Qwen2.5-0.5B-Instruct"
    # a path outside gets the same answer whether it exists or not, and never the server's folders
    answers = set()
    for value in (str(outside), str(tmp_path / "no-such-folder"), "/etc", "/no/such/dir", "~/x", "C:\\models"):
        with pytest.raises(ModelLoadError) as refused:
            validate_model_id(value, "target", models)
        answers.add(str(refused.value).replace(value, "<value>"))
        assert str(models) not in str(refused.value) and str(tmp_path) not in str(refused.value).replace(value, "")
    assert len(answers) == 1


def test_remote_code_requests_are_refused_unless_the_app_allows_them(pair):
    target, draft, tokenizer = pair
    calls = []

    def loader(*args, **kwargs):
        calls.append(args)
        raise AssertionError("must not load")

    w = Worker.from_models(target, draft, tokenizer, "a", "b", loader=loader)
    try:
        events = w.load_models("org/target", "org/draft", trust_remote_code=True).wait(30)
        assert events[-1].kind == "error" and "--models-panel-remote-code" in str(events[-1].data)
        assert calls == [] and w.info["target"] == "a"
    finally:
        w.close()


def fake_tuner():
    from engine.tuning.optimizer import AutoTuner
    from engine.tuning.profile import HardwareProfile
    profile = HardwareProfile(device="test", pair="tiny", dtype="float32", prefix_len=128,
                              target={1: 0.010, 4: 0.011, 16: 0.013, 64: 0.030},
                              draft={1: 0.001, 4: 0.0012, 16: 0.0015})
    return AutoTuner(profile, {(0.0, 1.0): [0.8, 0.1, 0.05]}, max_size=32, max_depth=6)


def test_auto_tree_reports_the_optimizer_choice(worker, pair):
    from app.page.ui import build_demo
    demo = build_demo(worker, pair[2])
    assert demo.chat_app.c.auto.visible is False  # no tuner: no auto checkbox
    worker.set_tuner(fake_tuner())
    try:
        auto = build_demo(worker, pair[2]).chat_app.c.auto
        assert auto.visible is True and auto.value is True  # the optimizer's pick by default
        events = worker.submit(GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=12, tree="auto"))).wait(60)
        assert events[-1].kind == "done"
        choice = events[0].data["decision"].choice
        assert choice is not None and choice.size > 1 and choice.predicted_speedup > 1
        assert all(e.data.tree_size == choice.size for e in events if e.kind == "step")
    finally:
        worker.set_tuner(None)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_models_panel_counts_and_names_a_quantised_draft(fmt):
    from app.views.text import pair_markdown
    from app.serving.pair import describe_pair
    from engine.backends.quantize import quantize_draft

    target, draft = support.tiny_pair()
    floats = sum(p.numel() for p in draft.parameters())
    info = describe_pair(target, quantize_draft(draft, fmt), "t", "d")
    assert info["draft_format"] == fmt
    assert abs(info["draft_params"] - floats) <= 1e-3 * floats  # packed weights count (int8 hides its biases)
    assert f"{fmt} weights" in pair_markdown(info)
    assert "weights" not in pair_markdown(describe_pair(target, draft, "t", "d")).split("**draft**")[1].split("\n")[0]


# ----- review findings: --models-dir bypass, pinned models, prompt Stop, swaps racing chats ----------
def _save_tiny_model(directory, vocab_words: int, seed: int = 0):
    """A tiny Qwen2 with a word-level tokenizer of ``vocab_words`` words, saved with save_pretrained."""
    import tiny_models as tm
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>"] + [f"w{i}" for i in range(vocab_words)])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                        unk_token="<unk>")
    tm.qwen2(seed=seed, vocab_size=len(vocab)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_a_hub_id_naming_a_folder_in_the_working_directory_is_refused(pair, tmp_path, monkeypatch):
    """``secret/model`` looks like a hub id, but from_pretrained would load the folder of that name under
    the server's working directory: outside --models-dir, so it must be refused and never read."""
    import transformers

    from app.serving.pair import default_loader

    _save_tiny_model(tmp_path / "secret" / "model", 31)
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    read = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, name, *args, original=original, **kwargs):
            read.append(str(name))
            return original(klass, name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    for value in ("secret/model", "secret", "./secret/model"):
        with pytest.raises(ModelLoadError, match="not a folder in the models folder"):
            validate_model_id(value, "target", models)
        with pytest.raises(ModelLoadError, match="not a folder in the models folder"):
            validate_model_id(value, "target")
    with pytest.raises(ModelLoadError, match="not a folder in the models folder"):
        default_loader("secret/model", torch.float32, "cpu", False)  # the loader refuses it too
    target, draft, tokenizer = pair
    w = Worker.from_models(target, draft, tokenizer, "a", "b", models_dir=models)
    try:
        events = w.load_models("secret/model", "secret/model").wait(30)
        assert events[-1].kind == "error" and "not a folder in the models folder" in events[-1].data
        assert w.info["target"] == "a" and w.pair_version == 0
    finally:
        w.close()
    assert read == [], f"read from disk: {read}"
    assert validate_model_id("Qwen/Qwen2.5-0.5B-Instruct", "target", models) == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_failed_pair_load_keeps_no_model_of_the_attempt_referenced(pair, tmp_path, monkeypatch):
    """Target and draft with different vocabularies: the load fails, and once it has, no model of
    that attempt is referenced anywhere (no loader cache pins the target); the pair stays usable."""
    import weakref

    from engine.models import loading as engine_models

    root = tmp_path / "models"
    _save_tiny_model(root / "org" / "target", 31, seed=0)
    _save_tiny_model(root / "org" / "draft", 40, seed=1)
    loaded = []
    original = engine_models._load_hub_model

    def spy(*args, **kwargs):
        model, tok = original(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model, tok

    monkeypatch.setattr(engine_models, "_load_hub_model", spy)
    target, draft, tokenizer = pair
    w = Worker.from_models(target, draft, tokenizer, "a", "b", models_dir=root, draft_format="none")
    try:
        events = w.load_models("org/target", "org/draft").wait(60)
        assert events[-1].kind == "error" and "different vocabularies" in events[-1].data
        assert len(loaded) == 2
        assert_let_go_and_the_old_pair_answers(w, pair, loaded, 5, "a model of the failed load is still referenced")
    finally:
        w.close()


def assert_let_go_and_the_old_pair_answers(w, pair, refs, seconds: float, message: str) -> None:
    """Every weakref in ``refs`` dies within ``seconds`` and the worker still serves the pair "a"
    it had, answering as the engine alone does."""
    assert support.wait_until(lambda: (gc.collect(), all(r() is None for r in refs))[1], seconds), message
    assert w.info["target"] == "a" and w.pair_version == 0
    ids = prompt(pair)
    events = w.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=8, tree=TREE))).wait(60)
    assert tokens_of(events) == reference(pair, ids, max_new_tokens=8, tree=TREE)


def test_stop_during_a_long_prefill_skips_the_remaining_chunks(pair):
    """A conversation of ~800 tokens prefills in several chunks; Stop pressed while the first chunk
    runs ends the job as cancelled before any other chunk (or the draft, or a step) runs."""
    import threading

    target, draft, tokenizer = pair
    w = Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": "t", "draft": "d"})
    ids = prompt(pair, "word " * 800)
    assert len(ids) - 1 > 2 * 256  # three chunks at least
    entered, resume, calls = threading.Event(), threading.Event(), []

    def hook(name):
        def pre_hook(module, args, kwargs):
            calls.append(name)
            if len(calls) == 1:
                entered.set()
                resume.wait(10)
        return pre_hook

    handles = [target.register_forward_pre_hook(hook("target"), with_kwargs=True),
               draft.register_forward_pre_hook(hook("draft"), with_kwargs=True)]
    try:
        job = w.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=50, tree=TREE)))
        assert entered.wait(30)
        job.cancel()  # from this thread, while the worker runs the first chunk
        resume.set()
        events = job.wait(30)
    finally:
        resume.set()
        for handle in handles:
            handle.remove()
        w.close()
    assert events[-1].kind == "cancelled"
    assert not any(e.kind == "step" for e in events)
    assert calls == ["target"], calls


def test_stop_answers_a_blocked_model_load_within_a_second(pair):
    """A load stuck in its loader (a slow download) is answered ``cancelled`` within 1 s of Stop; the
    orphaned load's result is discarded and freed once it returns, and the pair stays in use."""
    import threading
    import time
    import weakref

    import tiny_models as tm

    target, draft, tokenizer = pair
    gate, made = threading.Event(), []

    def loader(model_id, dtype, device, trust_remote_code, draft_format="none"):
        gate.wait(30)
        model = tm.qwen2()
        made.append(weakref.ref(model))
        return model, tokenizer

    w = Worker.from_models(target, draft, tokenizer, "a", "b", loader=loader)
    try:
        job = w.load_models("org/target", "org/draft")
        events = job.iter_events(timeout=10)
        assert next(events).kind == "progress"
        job.cancel()
        last = job.wait(2)[-1]  # the load itself waits on the gate: only the cancel can end the job
        assert last.kind == "cancelled" and not gate.is_set()
        gate.set()
        assert support.wait_until(lambda: bool(made), 10)
        assert_let_go_and_the_old_pair_answers(w, pair, made, 10, "the cancelled load's model is still referenced")
    finally:
        gate.set()
        w.close()


class RecordingTokenizer:
    """A tokenizer stand-in: the real one, with every chat-template call recorded under ``name``."""

    def __init__(self, inner, name: str, log: list) -> None:
        self._inner, self._name, self._log = inner, name, log

    def apply_chat_template(self, *args, **kwargs):
        self._log.append(self._name)
        return self._inner.apply_chat_template(*args, **kwargs)

    def __len__(self):
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def gated_swap(pair):
    """A worker on ``pair`` with an "old" tokenizer whose loader, once ``gate`` is set, swaps in the
    same models with a "new" one; ``used`` records which tokenizer encoded what, in order."""
    import threading

    target, draft, real = pair
    used: list[str] = []
    old, new = RecordingTokenizer(real, "old", used), RecordingTokenizer(real, "new", used)
    gate = threading.Event()

    def loader(model_id, dtype, device, trust_remote_code, draft_format="none"):
        gate.wait(30)
        return (target if model_id == "org/target" else draft), new

    return Worker.from_models(target, draft, old, "a", "b", loader=loader), used, old, new, gate


def test_a_chat_queued_behind_a_model_load_is_tokenised_with_the_new_pair(pair):
    """The UI submits a chat while a model load is running: the prompt is tokenised (and its context
    checked) when the job runs, with the tokenizer of the pair the load put in place."""
    from app.page.ui import build_demo

    w, used, old, new, gate = gated_swap(pair)
    try:
        app = build_demo(w, old).chat_app
        load = w.load_models("org/target", "org/draft")
        used.clear()
        # message, history, run, system, temperature, top_p, max_new, seed, method, size, depth, auto, compare, highlight
        chat = app.respond("Which tokenizer reads me?", [], None, "", 0.0, 1.0, 8, 0, "sequoia", 8, 4,
                           False, False, False)
        next(chat)  # submitted: waiting behind the load
        assert w.busy == 2
        gate.set()
        assert load.wait(30)[-1].kind == "done"
        final = list(chat)[-1]
        assert used and used[-1] == "new" and "new" in used, used
        history = final[app.c.history]
        assert history[-1]["role"] == "assistant" and history[-1]["content"]
    finally:
        gate.set()
        w.close()


def test_the_worker_tokenises_a_conversation_when_the_job_runs(pair):
    real = pair[2]
    w, used, old, new, gate = gated_swap(pair)
    try:
        load = w.load_models("org/target", "org/draft")
        messages = [{"role": "user", "content": "Which tokenizer reads me?"}]
        chat = w.submit(GenerationRequest(settings=DecodeSettings(max_new_tokens=8, tree=TREE), system="Be brief.", messages=messages),
                        session="tab")
        gate.set()
        assert load.wait(30)[-1].kind == "done"
        events = chat.wait(60)
        assert events[-1].kind == "done", events[-1]
        started = next(e for e in events if e.kind == "started")
        assert used == ["new"] and started.data["tokenizer"] is new and started.data["dropped"] == 0
        ids = encode_chat(real, [{"role": "system", "content": "Be brief."}] + messages)
        assert tokens_of(events) == reference(pair, ids, max_new_tokens=8, tree=TREE)
    finally:
        gate.set()
        w.close()


def gated_worker(pair):
    """``(worker, gate)``: a worker whose model loads wait for ``gate``, so a load holds the queue."""
    import threading

    target, draft, tokenizer = pair
    gate = threading.Event()

    def loader(model_id, dtype, device, trust_remote_code, draft_format="none"):
        gate.wait(30)
        return (target if model_id == "org/target" else draft), tokenizer

    return Worker.from_models(target, draft, tokenizer, "a", "b", loader=loader), gate


def test_one_session_gets_one_job_however_many_threads_submit_at_once(pair):
    """Eight threads submit for one browser session at the same moment: exactly one job is accepted
    (checking for a pending or running job and registering the new one is one locked step)."""
    import threading

    from app.serving.jobs import SessionBusy

    w, gate = gated_worker(pair)
    ids = prompt(pair)
    barrier = threading.Barrier(8)

    def submit():
        barrier.wait()
        try:
            return w.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=4, tree=TREE)), session="tab")
        except SessionBusy:
            return None

    try:
        w.load_models("org/target", "org/draft")  # keeps the worker busy: every chat stays pending
        jobs = support.run_in_threads([submit] * 8)
        accepted = [j for j in jobs if j is not None]
        assert len(accepted) == 1, f"{len(accepted)} jobs accepted for one session"
        other = w.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=4, tree=TREE)), session="another tab")
        gate.set()
        assert accepted[0].wait(60)[-1].kind == "done" and other.wait(60)[-1].kind == "done"
        again = w.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=4, tree=TREE)), session="tab")  # free again
        assert again.wait(60)[-1].kind == "done"
    finally:
        gate.set()
        w.close()


def test_a_full_queue_and_a_client_past_its_share_are_refused(pair, monkeypatch):
    """MAX_WAITING jobs wait at most (any client, UI sessions included); one client gets
    MAX_PER_CLIENT jobs waiting or running. Refusals say when to come back; others still get in."""
    from app.serving import worker as worker_module
    from app.serving.jobs import QueueFull

    monkeypatch.setattr(worker_module, "MAX_WAITING", 6)
    w, gate = gated_worker(pair)
    request = GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=2, tree=TREE))
    try:
        load = w.load_models("org/target", "org/draft")  # runs, holding the queue
        assert support.wait_until(lambda: w._current is load, 10)
        mine = [w.submit(request, client="api:10.0.0.7") for _ in range(worker_module.MAX_PER_CLIENT)]
        with pytest.raises(QueueFull, match="at most 4") as refused:
            w.submit(request, client="api:10.0.0.7")
        assert refused.value.retry_after > 0
        others = [w.submit(request, client="api:10.0.0.8"), w.submit(request, session="tab")]
        with pytest.raises(QueueFull, match="busy"):  # 6 waiting: nobody else gets in
            w.submit(request, session="another tab")
        mine[0].cancel()  # a freed place is free again
        w.submit(request, client="api:10.0.0.7")
        gate.set()
        assert all(job.wait(60)[-1].kind in ("done", "cancelled") for job in mine + others)
    finally:
        gate.set()
        w.close()


def test_api_calls_from_many_addresses_never_take_the_pages_places(pair, monkeypatch):
    """One machine with many loopback aliases (127.0.1.1, 127.0.1.2, ...) passes every per-client
    cap; API calls still hold at most API_WAITING of the MAX_WAITING places, so a page user can
    always queue an answer."""
    from app.serving import worker as worker_module
    from app.serving.jobs import QueueFull

    monkeypatch.setattr(worker_module, "MAX_WAITING", 6)
    monkeypatch.setattr(worker_module, "API_WAITING", 4)
    w, gate = gated_worker(pair)
    request = GenerationRequest(prompt(pair), settings=DecodeSettings(max_new_tokens=2, tree=TREE))
    try:
        load = w.load_models("org/target", "org/draft")  # runs, holding the queue
        assert support.wait_until(lambda: w._current is load, 10)
        aliases = [w.submit(request, client=f"api:127.0.1.{i}") for i in range(1, 5)]
        with pytest.raises(QueueFull, match="busy"):
            w.submit(request, client="api:127.0.1.5")
        pages = [w.submit(request, session="tab"), w.submit(request, session="another tab")]
        with pytest.raises(QueueFull, match="busy"):  # now every place is taken
            w.submit(request, session="a third tab")
        gate.set()
        assert all(job.wait(60)[-1].kind in ("done", "cancelled") for job in aliases + pages)
    finally:
        gate.set()
        w.close()


def test_the_worker_fits_the_conversation_to_the_context_when_the_job_runs(worker, pair):
    worker.engine.max_context = 160  # the wrapper's view, which the worker budgets against
    try:
        long = "tree " * 60
        turns = [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
                 {"role": "user", "content": long}]
        events = worker.submit(GenerationRequest(settings=DecodeSettings(max_new_tokens=8, tree=Tree.chain(4)), messages=turns)).wait(60)
        started = next(e for e in events if e.kind == "started")
        assert events[-1].kind == "done" and started.data["dropped"] == 2
        assert started.data["prompt_tokens"] == len(encode_chat(pair[2], turns[2:]))
        too_long = [{"role": "user", "content": "tree " * 400}]
        events = worker.submit(GenerationRequest(settings=DecodeSettings(max_new_tokens=8, tree=Tree.chain(4)), messages=too_long)).wait(60)
        assert events[-1].kind == "error" and events[-1].data.startswith("Not sent:")
        assert "shorten it" in events[-1].data
    finally:
        del worker.engine.max_context


def test_measuring_the_machine_replaces_a_borrowed_profile_and_keeps_it(worker, pair, tmp_path, monkeypatch):
    """The first start's background job: this machine's profile of the pair (target sizes 1..16, draft
    widths 1..4, the step overhead) replaces a borrowed one in the optimizer, labelled as measured
    here, and is kept in the user cache where the next start's load_tuner finds it."""
    import dataclasses

    from engine.tuning.optimizer import load_tuner
    from engine.tuning.profile import QUICK_SIZES, QUICK_WIDTHS

    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path))
    borrowed = dataclasses.replace(fake_tuner(), pair="tiny+tiny", origin="nearest bundled profile, measured on test")
    worker.set_tuner(borrowed)
    try:
        assert not worker.tuner.measured_here
        events = worker.measure_machine().wait(300)
        assert events[-1].kind == "done", events[-1]
        tuner = worker.tuner
        assert tuner is not borrowed and tuner.measured_here and tuner.acceptance == borrowed.acceptance
        assert sorted(tuner.profile.target) == QUICK_SIZES and sorted(tuner.profile.draft) == QUICK_WIDTHS
        assert all(t > 0 for t in [*tuner.profile.target.values(), *tuner.profile.draft.values()])
        kept = list((tmp_path / "profiles").glob("*.json"))
        assert len(kept) == 1 and kept[0].name.startswith(tuner.profile.device)
        # the pair's calibration is bundled, not in the user cache: the measured profile is used all the same
        from engine.tuning.calibrate import Acceptance, acceptance_path

        bundled = tmp_path / "bundled"
        path = acceptance_path(bundled / "acceptance", "tiny+tiny", 0.0, 1.0)
        path.parent.mkdir(parents=True)
        path.write_text(Acceptance("tiny+tiny", 0.0, 1.0, 100, [80, 10, 5], [0.8, 0.1, 0.05]).to_json())
        monkeypatch.setattr("engine.models.prompts.ASSETS", bundled)
        again = load_tuner("tiny+tiny", pair[0])
        assert again is not None and again.measured_here and again.profile == tuner.profile
    finally:
        worker.set_tuner(None)



def test_an_expected_output_is_copied_from_in_the_main_phase_only(worker, pair):
    """The edit mode's expected output (and copies from the chat) reach the engine for the answer,
    never for the target alone of Compare; the answer is the engine's own greedy one."""
    ids = prompt(pair)
    expected = reference(pair, ids, max_new_tokens=30, tree=TREE)
    text = pair[2].decode(expected, skip_special_tokens=True)
    events = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=30, tree=TREE), compare=True, prediction=text)).wait(120)
    assert events[-1].kind == "done"
    assert tokens_of(events) == expected == tokens_of(events, "compare")
    main = [e.data for e in events if e.kind == "step" and e.phase == "main"]
    baseline = [e.data for e in events if e.kind == "step" and e.phase == "compare"]
    assert sum(s.accepted_by_source()["copy"] for s in main) >= 5
    assert all(not s.sources for s in baseline)
    off = worker.submit(GenerationRequest(ids, settings=DecodeSettings(max_new_tokens=30, tree=TREE, copies=False))).wait(120)
    assert all(not e.data.sources for e in off if e.kind == "step")


def test_the_free_draft_settings_are_per_session(pair):
    from app.page.handlers import ChatApp

    target, draft, tokenizer = pair
    w = Worker(make_engine(target, draft, tokenizer), tokenizer, {"target": "tiny-target", "draft": "tiny-draft"})
    try:
        chat = ChatApp(w, tokenizer)
        assert chat.free_drafts("local") == (True, None)
        chat.set_free_drafts(False, "  def f():\n    return 1\n")
        assert chat.free_drafts("local") == (False, "  def f():\n    return 1\n")
        chat.set_free_drafts(True, "   ")
        assert chat.free_drafts("local") == (True, None)
        assert chat.free_drafts("other") == (True, None)
    finally:
        w.close()
