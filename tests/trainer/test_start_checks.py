"""What a run's start needs of the model folder and the envs is refused where the config loads
(so ``--dry-run`` refuses it too, exit 2), in one line naming the fix, not after the workers
started with a library's own message:

- a model folder whose tokenizer cannot render chats: no tokenizer files (transformers then
  quietly built a tokenizer of length 1), or no chat template (a base checkpoint) while
  ``model.chat_template`` is not set; a base checkpoint *with* ``model.chat_template`` trains;
- a warm start that plays an expert (``sft.source: expert``) on an env that has none.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs the train extra: pip install -e '.[train]'")
from click.testing import CliRunner

import envhub
from envhub.cli import main
from trainer.config import load_config
from trainer.errors import ConfigError, ModelError, TrainerError
from trainer.models import CHATML_TEMPLATE, load_policy

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
CHEAP = ["train.steps=0", "eval.episodes=2", "logging.progress=false", "model.tiny=null"]


@pytest.fixture
def base(policy_dir: Path, tmp_path: Path) -> Path:
    """The tiny policy as a base checkpoint: weights and tokenizer, no chat template."""
    folder = shutil.copytree(policy_dir, tmp_path / "base")
    (folder / "chat_template.jinja").unlink()
    return folder


@pytest.fixture
def no_tokenizer(policy_dir: Path, tmp_path: Path) -> Path:
    """The tiny policy's config and weights without its tokenizer files."""
    folder = shutil.copytree(policy_dir, tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    return folder


def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(QUICKSTART, [*CHEAP, *overrides])
    return [str(p) for p in caught.value.problems]


def test_a_base_checkpoint_is_refused_where_the_config_loads(base: Path) -> None:
    [problem] = problems_of(f"model.path={base}")
    assert problem.startswith(
        f"model.path: {str(base)!r} has no chat template (a base checkpoint?): use an instruct "
        "checkpoint or set model.chat_template"
    )


def test_a_folder_without_tokenizer_files_is_refused_where_the_config_loads(
    no_tokenizer: Path,
) -> None:
    [problem] = problems_of(f"model.path={no_tokenizer}")
    assert problem.startswith(
        f"model.path: {str(no_tokenizer)!r} has no tokenizer files (tokenizer.json / "
        "tokenizer_config.json)"
    )


def test_the_dry_run_refuses_a_base_checkpoint(base: Path, tmp_path: Path) -> None:
    args = ["train", str(QUICKSTART), *CHEAP, f"model.path={base}", "--dry-run"]
    result = CliRunner().invoke(main, [*args, f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert "has no chat template (a base checkpoint?)" in result.stderr
    assert "fits" not in result.stdout


def test_the_loaders_say_it_in_the_same_words(base: Path, no_tokenizer: Path) -> None:
    from trainer.models import load_tokenizer

    with pytest.raises(ModelError, match=r"has no chat template \(a base checkpoint\?\)"):
        load_tokenizer(base)
    with pytest.raises(ModelError, match=r"has no chat template \(a base checkpoint\?\)"):
        load_policy(base)
    with pytest.raises(ModelError, match=r"has no tokenizer files"):
        load_tokenizer(no_tokenizer)


def test_a_base_checkpoint_with_model_chat_template_trains(base: Path, tmp_path: Path) -> None:
    """The template given in the config renders the chats, the workers (which never render one:
    the driver does) load the folder as it is, and the final policy carries the template."""
    import yaml

    from tests.trainer.test_cli import TINY
    from trainer.models import load_tokenizer
    from trainer.pipeline import AgenticPipeline

    assert load_tokenizer(base, chat_template=CHATML_TEMPLATE).chat_template == CHATML_TEMPLATE
    config = yaml.safe_load(QUICKSTART.read_text())
    config["model"] = {"path": str(base), "chat_template": CHATML_TEMPLATE}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    cfg = load_config(
        tmp_path / "base.yaml",
        [
            *(o for o in TINY if not o.startswith("model.")), "sft.epochs=1", "sft.episodes=8",
            "train.steps=1", "env.num_groups=1", "algorithm.loss.kl_coef=0.1", f"output_dir={out}",
        ],
    )  # fmt: skip
    rows = AgenticPipeline(cfg).fit()
    assert rows[-1]["step"] == 1
    assert (out / "final_policy" / "chat_template.jinja").read_text() == CHATML_TEMPLATE


# --------------------------------------------------------------------------- the expert


class _Echo(envhub.TextEnv):
    def on_reset(self, options):
        return "Say something.", {}

    def on_step(self, action):
        return envhub.Turn(f"You said: {action}", terminated=True)


def _make_echo(**kwargs):
    return _Echo(**kwargs)


NO_EXPERT, NO_EXPERT_FACTORY = "test/start-checks-echo-v0", "test/start-checks-echo-factory-v0"
if NO_EXPERT not in envhub.registry.registry:
    envhub.register(NO_EXPERT, entry_point=_Echo, max_turns=3)
    envhub.register(NO_EXPERT_FACTORY, entry_point=_make_echo, max_turns=3)


def test_an_expert_warm_start_on_an_env_without_an_expert_is_refused_at_load() -> None:
    [problem] = problems_of(f"env.id={NO_EXPERT}", "env.kwargs={}", "sft.epochs=1", "model.tiny={}")
    assert problem.startswith("sft.source: ")
    assert f"{NO_EXPERT} has no expert" in problem
    assert "set sft.epochs=0 to skip the warm start" in problem
    assert "sft.source: file with sft.path" in problem
    load_config(QUICKSTART, [*CHEAP, f"env.id={NO_EXPERT}", "env.kwargs={}", "sft.epochs=0",
                             "model.tiny={}"])  # fmt: skip


def test_an_env_whose_expert_cannot_be_seen_before_playing_is_refused_when_played(
    policy_dir: Path,
) -> None:
    """An entry point that is a function hides its class: the warm start says it as it plays."""
    from trainer.rollout.trajectory import ChatRenderer
    from trainer.sft import expert_trajectories

    renderer = ChatRenderer(load_policy(policy_dir)[1])
    with pytest.raises(TrainerError, match="set sft.epochs=0 to skip the warm start"):
        expert_trajectories([NO_EXPERT_FACTORY], {}, renderer, episodes=1, max_turns=2)
