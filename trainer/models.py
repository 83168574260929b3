"""Policies as Hugging Face causal LMs: load a local checkpoint, or build a tiny one to train.

A real run points ``model.path`` at a local folder (e.g. Qwen2.5-0.5B-Instruct) and loads it
with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``. Nothing
can be downloaded here, so the CPU quickstart *builds* a policy instead: a tiny model from a
config (Qwen2, Llama or GPT-2; 0.1-2M parameters) and a small tokenizer made with the
``tokenizers`` library over the game's own vocabulary, wrapped as a
``PreTrainedTokenizerFast`` with a ChatML chat template. ``build_policy`` saves both with
``save_pretrained`` and every later stage loads them back through the very same
``load_policy(path)`` a user's checkpoint takes, so the two paths cannot drift apart.

Tokenizer kinds
---------------
``bpe``   byte-pair merges learnt on the env's own texts. Digits stay single tokens and
          each grid row (a line of single-character cells, ``P F H``) is its own piece, so
          the fixed prose of a game collapses into a few tokens and a grid becomes one token
          per row: short sequences (fast on a CPU) whose rows sit at fixed offsets from the
          end of every turn, which a tiny RoPE model reads far more easily than cells.
``word``  words with their leading space (`` up``), single digits, ``\\n``, punctuation.
``char``  one token per character: tiny vocabulary, long sequences.
All three round-trip exactly (``decode(encode(text)) == text``) on text made of characters
the corpus contains; anything else becomes ``<unk>``.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainer.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_model",
    "build_policy",
    "build_tokenizer",
    "count_parameters",
    "env_corpus",
    "load_policy",
    "load_tokenizer",
    "tokenizer_problem",
]

TokenizerKind = Literal["bpe", "word", "char"]
_KIND_ALIASES = {"chars": "char", "words": "word", "char": "char", "word": "word", "bpe": "bpe"}
Architecture = Literal["llama", "gpt2"]

PAD, UNK, IM_START, IM_END = "<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, IM_START, IM_END)
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}"
    "{%- endif %}"
    '{{- \'# Tools\nCall a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    " Tools:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>{\"arguments\": ' + (call['function']['arguments']"
    " if call['function']['arguments'] is string else call['function']['arguments'] | tojson)"
    " + ', \"name\": ' + (call['function']['name'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""ChatML (as Qwen uses), without a default system prompt. With ``tools=`` it lists their
schemas in the system turn and renders assistant ``tool_calls`` the hermes way, one
``<tool_call>{"arguments": ..., "name": ...}</tool_call>`` per line after the content: exactly
what ``envhub.parsing.format_tool_call`` writes (the envs' experts, so the warm-started policy),
so a turn re-rendered from its structured message reads as the policy wrote it. ``rollout.
tool_parser: auto`` reads it as ``hermes``; tool results are ``tool`` turns. Append-only either
way."""

_WORD_PIECES = r" ?[A-Za-z]+| ?\d|\n|\s|[^\sA-Za-z\d]"
_CHAR_PIECES = r"[\s\S]"
_BPE_ISOLATED = r" ?\d|^\S(?: \S)+$"


MAX_MESSAGE_CHARS = 20_000
"""The corpus keeps at most this much of one text (a message's content or an action)."""
MAX_EPISODE_CHARS = 200_000
"""...and of one episode; ``MAX_EPISODE_STEPS`` steps at most (an env that never ends)."""
MAX_EPISODE_STEPS = 500
MAX_CORPUS_CHARS = 4_000_000
"""...and of one env's whole corpus. The built-in envs' corpora (300 episodes: 0.3-0.8 M
characters, messages under 1,000) stay well inside these bounds; an env with huge observations
(36 MB per reset) once made the corpus 10 GB and the tokenizer trainer 11 GB of RAM."""


def env_corpus(
    env_id: str, env_kwargs: dict[str, Any] | None = None, episodes: int = 200, seed: int = 0
) -> list[str]:
    """Texts an env produces (observations and actions) over seeded episodes.

    Plays the env's expert and its random ``sample_action`` alternately so feedback for
    invalid actions is covered too; the result is the tokenizer's training corpus, bounded by
    ``MAX_MESSAGE_CHARS``, ``MAX_EPISODE_CHARS``/``MAX_EPISODE_STEPS`` and ``MAX_CORPUS_CHARS``
    (the episodes stop once it is full). The env is played in this process, so an env whose
    reset or step raises or returns an observation that is not chat messages is a
    ``ModelError`` naming the env, the seed and the ``envhub check`` command that shows the
    problem; a constructor's error (a refused setting) is raised as it is.
    """
    import numpy as np

    import envhub

    kwargs = dict(env_kwargs or {})
    rng = np.random.default_rng(seed)
    env = envhub.make(env_id, **kwargs)  # a refused setting: the constructor's own error, as is
    env.action_space.seed(seed)  # random actions too: the same corpus (and tokenizer) everywhere
    texts: list[str] = [
        "system\n",
        "user\n",
        "assistant\n",
        "tool\n",
    ] * episodes  # chat-template glue
    room = MAX_CORPUS_CHARS - sum(map(len, texts))
    episode_seed: int | None = None
    try:
        for episode in range(episodes):
            if room <= 0:
                break
            episode_seed = seed + episode
            played = _episode_texts(env, episode_seed, rng, min(room, MAX_EPISODE_CHARS))
            texts += played
            room -= sum(map(len, played))
        episode_seed = None
        _call("close()", env.close)
    except _EnvFault as fault:
        with contextlib.suppress(Exception):  # the fault is what to report
            env.close()
        raise _corpus_error(env_id, kwargs, episode_seed, str(fault)) from fault.__cause__
    return texts


class _EnvFault(Exception):
    """An env call failed, or returned what is not chat messages (the message says which)."""


def _episode_texts(env: Any, seed: int, rng: Any, room: int) -> list[str]:
    """The texts of the episode at ``seed``, in order (opening messages, then each action and
    the env's reply), each cut to ``MAX_MESSAGE_CHARS``, all together to ``room`` characters."""
    texts: list[str] = []

    def keep(new: list[str]) -> bool:  # False once the room is used up
        nonlocal room
        for text in new:
            text = text[: min(MAX_MESSAGE_CHARS, room)]
            texts.append(text)
            room -= len(text)
            if room <= 0:
                return False
        return True

    messages, _ = _call("reset", env.reset, seed=seed)
    if not keep(_contents(messages, "reset")):
        return texts
    for _ in range(MAX_EPISODE_STEPS):
        expert = _call("expert_action()", env.expert_action)
        action = (
            expert
            if expert is not None and rng.random() < 0.7
            else _call("action_space.sample()", env.action_space.sample)
        )
        messages, _, terminated, truncated, _ = _call("step", env.step, action)
        if not keep([_action_text(action), *_contents(messages, "step")]):
            break
        if terminated or truncated:
            break
    return texts


def _call(what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``; what it raises becomes an ``_EnvFault`` naming ``what``."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        raise _EnvFault(f"{what} raised {_quote(exc)}") from exc


def _contents(messages: Any, what: str) -> list[str]:
    """The contents of an observation, or ``_EnvFault`` when it is not a list of messages."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise _EnvFault(
            f"{what} returned an observation that is not a list of chat messages "
            f"({{'role': ..., 'content': str}}): {messages!r:.120}"
        )
    return [m["content"] for m in messages]


def _action_text(action: Any) -> str:
    if isinstance(action, str):
        return action
    if isinstance(action, dict):  # an assistant message (a structured action)
        from envhub.parsing import message_text

        return message_text(action)
    raise _EnvFault(
        f"expert_action() returned {type(action).__name__} {action!r:.60}; it must return the "
        "model's text (a str), an assistant message or None"
    )


def _quote(exc: BaseException) -> str:
    """``"KeyError: 'best' (at envs.py:50)"``: the error and the line of the env that raised
    (envhub's own errors say what to fix without it)."""
    import traceback

    from envhub.errors import EnvhubError, describe_error

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return describe_error(exc, limit=300) + ("" if isinstance(exc, EnvhubError) else where)


def _corpus_error(env_id: str, kwargs: dict[str, Any], seed: int | None, what: str) -> ModelError:
    from envhub.server.config import kwarg_flags

    check = " ".join(
        filter(
            None,
            [
                "envhub check",
                env_id,
                f"--seed {seed}" if seed is not None else "",
                kwarg_flags(kwargs),
            ],
        )
    )
    episode = f"seed {seed} " if seed is not None else ""
    return ModelError(
        f"building the tokenizer corpus from {env_id}: {episode}{what}; run `{check}` to see "
        "the problem (the corpus plays the env's expert and random actions), and fix the env"
    )


def build_tokenizer(corpus: Iterable[str], kind: str = "bpe", max_vocab: int = 2048) -> Any:
    """A small tokenizer over ``corpus`` (see "Tokenizer kinds"), with ChatML special tokens.

    Returns a ``PreTrainedTokenizerFast``; specials come first (``<|endoftext|>`` is id 0,
    the pad token) and ``<|im_end|>`` is the end-of-turn (EOS) token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    resolved = _KIND_ALIASES.get(kind)
    if resolved is None:
        raise ModelError(f"unknown tokenizer kind {kind!r}; use 'bpe', 'word' or 'char'")
    texts = list(corpus)
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    if resolved == "bpe":
        backend = Tokenizer(models.BPE(unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(_BPE_ISOLATED), behavior="isolated")
        trainer = trainers.BpeTrainer(
            vocab_size=max_vocab,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=alphabet,
            show_progress=False,
            max_token_length=256,
        )
        backend.train_from_iterator(texts, trainer)
    else:
        splitter = pre_tokenizers.Split(
            Regex(_WORD_PIECES if resolved == "word" else _CHAR_PIECES), behavior="isolated"
        )
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(piece for piece, _ in splitter.pre_tokenize_str(text))
        if resolved == "char":
            counts.update(dict.fromkeys(alphabet, 0))
        pieces = [
            p
            for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            if p not in SPECIAL_TOKENS
        ]
        vocab = {
            t: i
            for i, t in enumerate(
                [*SPECIAL_TOKENS, *pieces[: max(0, max_vocab - len(SPECIAL_TOKENS))]]
            )
        }
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        backend.pre_tokenizer = splitter
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _arch_config(
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    intermediate_size: int,
    max_positions: int,
    tokens: dict[str, int],
) -> Any:
    from transformers import AutoConfig

    if arch == "gpt2":
        return AutoConfig.for_model(
            "gpt2",
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=intermediate_size,
            n_positions=max_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            **tokens,
        )
    if arch == "qwen2":
        raise ModelError(
            "model.tiny.architecture 'qwen2' cannot be built here: transformers' AutoTokenizer "
            "always loads model_type qwen2 with Qwen2Tokenizer, which cannot hold a tokenizer "
            "built from an env corpus. Use 'llama' (the same block: RMSNorm, RoPE, SwiGLU) or "
            "load a real Qwen2 checkpoint with model.path"
        )
    if arch == "llama":
        return AutoConfig.for_model(
            arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads or num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            rope_theta=10_000.0,
            **tokens,
        )
    raise ModelError(f"unknown model.tiny.architecture {arch!r}; use 'llama' or 'gpt2'")


def build_model(
    tokenizer: PreTrainedTokenizerBase,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int = 256,
    max_positions: int = 2048,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised causal LM sized for ``tokenizer`` (seeded, so reproducible)."""
    import torch
    from transformers import AutoModelForCausalLM

    if hidden_size % num_heads:
        raise ModelError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    tokens = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.pad_token_id,
    }
    config = _arch_config(
        arch,
        len(tokenizer),
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        max_positions,
        tokens,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(state)
    return model


def build_policy(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    tokenizer_kind: str = "bpe",
    vocab_size: int = 2048,
    **model_kwargs: Any,
) -> Path:
    """Build a tokenizer (at most ``vocab_size`` entries) over ``corpus`` and a tiny model;
    ``save_pretrained`` both to ``out_dir``."""
    out = Path(out_dir)
    tokenizer = build_tokenizer(corpus, tokenizer_kind, max_vocab=vocab_size)
    model = build_model(tokenizer, **model_kwargs)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "envhub_policy.json").write_text(
        json.dumps({"tokenizer_kind": tokenizer_kind, "vocab_size": vocab_size, **model_kwargs})
    )
    return out


def weights_problem(path: str | Path) -> str | None:
    """Why the weight files in the folder ``path`` cannot load, from what is cheap to read: the
    shard index and each safetensors file's header (no weights are read). A truncated or
    half-downloaded checkpoint is then refused where the config is loaded (and by
    ``--dry-run``), not in a worker after the cluster started. None: they look whole (or there
    are none to check)."""
    from safetensors import safe_open

    folder = Path(path).expanduser()
    again = "the checkpoint is incomplete or corrupt: copy or download it again"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return f"{index} cannot be read ({type(error).__name__}: {error}); {again}"
        missing = sorted(str(shard) for shard in shards if not (folder / str(shard)).is_file())
        if missing:
            lacking = ", ".join(missing[:3])
            return f"{index.name} lists weight files {folder} lacks ({lacking}); {again}"
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as error:  # noqa: BLE001 - SafetensorError, OSError: all say "unreadable"
            return f"{file} is not a readable safetensors file ({error}); {again}"
    return None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tekken.json",
)
"""Files that hold a tokenizer's vocabulary (fast, SentencePiece, BPE, WordPiece, Mistral's;
``*.tiktoken`` too): a model folder without one has no tokenizer, and ``AutoTokenizer`` then
quietly builds one of length 1 from the model's config."""


def _has_vocabulary(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(
        folder.glob("*.tiktoken")
    )


def _has_chat_template(folder: Path) -> bool:
    """Whether the folder's tokenizer files carry a chat template, where transformers reads one:
    ``chat_template.jinja``, ``additional_chat_templates/``, ``chat_template.json`` or the
    ``chat_template`` of ``tokenizer_config.json``."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    if any((folder / "additional_chat_templates").glob("*.jinja")):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def _no_tokenizer(folder: Path) -> str:
    return (
        f"{str(folder)!r} has no tokenizer files (tokenizer.json / tokenizer_config.json); copy "
        "them from the checkpoint the weights came from (a save_pretrained folder holds both)"
    )


def _no_chat_template(folder: Path) -> str:
    return (
        f"{str(folder)!r} has no chat template (a base checkpoint?): use an instruct checkpoint "
        "or set model.chat_template"
    )


def tokenizer_problem(path: str | Path, chat_template: str | None = None) -> str | None:
    """Why the tokenizer in the folder ``path`` cannot render the policy's chats, from its files
    (nothing is loaded): no vocabulary file, or no chat template while ``chat_template`` (the
    run's ``model.chat_template``) is not given. Checked where the config is loaded (and by
    ``--dry-run``), so a base checkpoint is refused before anything starts. A folder holding
    neither weights nor tokenizer files (a checkpoint's ``config.json`` alone, which ``--dry-run``
    plans from) has nothing to check: None."""
    folder = Path(path).expanduser()
    if not _has_vocabulary(folder):
        if not (folder / "tokenizer_config.json").is_file() and not any(
            any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.bin")
        ):
            return None
        return _no_tokenizer(folder)
    if chat_template or _has_chat_template(folder):
        return None
    return _no_chat_template(folder)


def load_tokenizer(
    path: str | Path, *, chat_template: str | None = None, chat: bool = True
) -> PreTrainedTokenizerBase:
    """``AutoTokenizer`` of the local folder ``path``, with clear errors: its files must hold a
    vocabulary and it must define an EOS token (a missing pad token falls back to EOS).
    ``chat_template`` (``model.chat_template``) replaces its own template. With ``chat`` (who
    renders chats: the driver's renderer, a judge) it must then have a template; the workers,
    which only take token ids, pass False (the driver refused a template-less folder first)."""
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    if not _has_vocabulary(folder):
        raise ModelError(_no_tokenizer(folder))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError) as error:
        raise ModelError(
            f"the tokenizer in {str(folder)!r} cannot be loaded ({type(error).__name__}: "
            f"{error}); check that it is a complete save_pretrained folder of a causal LM"
        ) from error
    if tokenizer.eos_token_id is None:
        raise ModelError(
            f"the tokenizer in {str(folder)!r} has no eos_token; set one in tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = chat_template
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ModelError(_no_chat_template(folder))
    return tokenizer


def load_policy(
    path: str | Path, *, dtype: str = "float32", chat: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``AutoModelForCausalLM`` + its tokenizer (``load_tokenizer``, ``chat`` as there) from a
    local folder, with clear errors."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelError(
            f"model path {str(path)!r} does not exist or is not a folder; set model.path to a "
            "local checkpoint folder (with config.json), or remove model.path to build a tiny "
            "policy"
        )
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"model path {str(folder)!r} has no config.json; point model.path at a "
            "save_pretrained folder"
        )
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    problem = weights_problem(folder)
    if problem is not None:
        raise ModelError(f"model.path: {problem}")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError) as error:
        raise ModelError(
            f"model.path {str(folder)!r} cannot be loaded ({type(error).__name__}: {error}); "
            "check that it is a complete save_pretrained folder of a causal LM"
        ) from error
    return model, load_tokenizer(folder, chat=chat)


def count_parameters(model: Any) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
