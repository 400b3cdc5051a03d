"""Every shell and Python example in README.md and the manual (docs/*.md) runs, so no example can rot.

The pages: :data:`PAGES` (README.md, then every ``docs/*.md`` by name). Test ids name the page and the block's line
(``docs/plans.md:L120-bash``). A block repeated verbatim on another page (the README's tour shows examples of the
manual) runs once, under its first page. Every relative link of the pages must name an existing file, and an anchor
an existing heading (:func:`test_relative_links_point_at_files`).

Which fenced blocks run (the rule; new examples are picked up automatically):

- ```` ```bash ```` / ```` ```sh ```` / ```` ```shell ````: each block is one bash script (``set -euo pipefail``: every
  command must exit 0; background jobs ``&`` are waited for and must exit 0 too), run in a fresh temporary directory
  with the venv's ``bin`` first on ``PATH`` (``python``, ``jaxckpt-report``, ``jaxckpt-plan`` are the venv's) and the
  repository on ``PYTHONPATH``. ``\\``-continued lines are joined; ``#`` comments are dropped.

  * Install lines (``python3 -m venv ...``, ``pip install ...``) are skipped: they create a venv and install from
    PyPI, which is how the environment running this test was made; running them here would need the network and
    minutes, and the tests they end with are this suite.
  * The test command (``python -m pytest ...``) is skipped: it is this suite.
  * Heavy commands are shrunk by :data:`OVERRIDES`: arguments appended to every command a pattern matches (argparse
    keeps the last value of a flag, so ``--preset tiny`` wins over the example's ``--preset small``). Shrinking keeps
    the code path (same program, flags, policies), only sizes and step counts change. A command whose point depends
    on its size (an absolute memory budget) is not shrunk.
  * Files an example treats as the user's own (``my_images.npz``, ``my_texts/``, ``mypkg.targets``) are created
    first by :data:`SETUP`, as a user would have them.
  * Blocks with a command matched by :data:`SLOW` are marked ``slow`` (still run by ``.ci/run``).
  * Blocks with a command matched by :data:`NEEDS_COMPILER` (``--topology`` of a TPU slice: the TPU compiler; of a
    GPU cluster: XLA:GPU of JAX's CUDA plugin) are skipped when that compiler is not installed, unless
    ``JAXCKPT_REQUIRE_TPU=1`` / ``JAXCKPT_REQUIRE_GPU=1`` (CI installs ``.[tpu,gpu]`` and sets both: then they run).

- ```` ```python ````: each block runs on its own, in a fresh namespace, in a temporary working directory: it must
  define what it uses. A block written as an interactive session (lines starting with ``>>> ``) is a display: each
  ``>>>`` statement runs with ``jax``, ``jnp`` and ``jaxckpt`` imported, and an output line ``ErrorType: message``
  under it must be what the statement raises (the type's name, and the message with ``...`` matching anything).

- Everything else is output or grammar and does not run: ```` ``` ```` without a language (policy examples, the EBNF
  grammar, the file tree), ```` ```text ````. A fence language outside :data:`RUN_LANGUAGES` and
  :data:`TEXT_LANGUAGES` fails :func:`test_every_fence_language_has_a_rule`, so a new kind of block gets a rule.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests import extras

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES: tuple[Path, ...] = (README, *sorted((REPO / "docs").glob("*.md")))
"""The pages whose examples run: the front page, then the manual."""

SHELL_LANGUAGES = ("bash", "sh", "shell")
PYTHON_LANGUAGES = ("python", "py")
RUN_LANGUAGES = SHELL_LANGUAGES + PYTHON_LANGUAGES
TEXT_LANGUAGES = ("", "text", "ebnf")
"""Fence languages that are output, grammar or trees: never run."""

SKIP = (
    (re.compile(r"^python3? -m venv\b|\bpip install\b"),
     "install line: creates a venv and installs from PyPI, as the environment running this test was made"),
    (re.compile(r"^python -m pytest\b"), "the test command: it runs this suite, which includes this test"),
    (re.compile(r"^(xprof|tensorboard) "),
     "viewer line: starts a web server for a person to browse (the traces it reads are tested in "
     "tests/training/test_profile.py)"),
    (re.compile(r"^jaxckpt-fit --model gpt --preset gpt2-small --topology v5e:2x2$"),
     "run by tests/sharding/test_topology.py's fit_on_topology fixture: the same command after this file's overrides "
     "(GPT tiny, 8 MiB, nothing_saveable on v5e:2x2), whose answer that test checks; running it twice cost 87 s of CI"),
    (re.compile(r"^jaxckpt-fit --model llm --preset llama-tiny --layers 8 --seq-len 1024 --topology v5e:2x2 "),
     "run by tests/fit/test_names.py's test_an_offload_list_fits_below_every_fixed_policy_on_a_topology, the same "
     "command (OFFLOAD_BELOW_FIXED, checked against this text there), whose answer it checks: 85 s of CI once"),
)
"""``(pattern, reason)``: commands not run."""


@dataclasses.dataclass(frozen=True)
class Override:
  """Arguments appended to every example command ``pattern`` matches, and why."""

  pattern: str
  extra: str
  reason: str


OVERRIDES: tuple[Override, ...] = (
    Override(r"python -m experiments\.classifier", "--preset tiny --epochs 1 --no-progress",
             "a real run trains ~1 min; the tiny preset for one epoch runs the same code"),
    Override(r"python -m experiments\.lm",
             "--preset tiny --max-seq-length 32 --steps 4 --eval-every 4 --eval-batches 1 --warmup-steps 1 "
             "--no-progress", "the default run takes 600 steps"),
    Override(r"(jaxckpt-report|python -m jaxckpt\.report) .*--model(?!.*--preset \S+-tiny\b)",
             "--preset tiny --batch-size 8", "small / gpt2-small presets compile for seconds to minutes per policy"),
    Override(r"(jaxckpt-report|python -m jaxckpt\.report) .*--model.*--preset \S+-tiny\b", "--batch-size 8",
             "a tiny preset of its own (mixtral-tiny) stays: its policies name its checkpoint names, which a "
             "checkpoint-name typo check refuses on another model"),
    Override(r"jaxckpt-report .*--topology v6e:16x16", "--topology v5e:2x2 --mesh fsdp=4 --seq-len 256 --batch-size 4",
             "Llama 3.1 8B on 256 chips compiles for 5-8 min per policy on 2 cores (13 min for docs/llm.md's command);"
             " the tiny preset on 4 chips runs the same policies, offload included, through the splash kernel on a "
             "topology"),
    Override(r"jaxckpt-report .*--policies all budget:30% budget:50% budget:75%",
             "--policies none nothing_saveable dots_saveable budget:50%",
             "every policy and three budgets on the tiny preset took 90 s of the block's 238 s in CI; three fixed "
             "policies and one budget draw the same Pareto plot through the same code"),
    Override(r"jaxckpt-fit .*--preset gpt2-small", "--preset tiny --memory 48MiB",
             "GPT-2 small compiles for ~20 s each, 17 times; the tiny preset in a memory scaled to it runs the same "
             "search"),
    Override(r"jaxckpt-fit .*--topology", "--preset tiny --memory 8MiB --policies nothing_saveable",
             "TPU compiles of GPT small at the batches 2 GiB holds take minutes each; GPT tiny under one policy in a "
             "memory scaled to it runs the same search on the topology (the four default policies took 214 s of CI's "
             "slow tier; tests/sharding/test_topology.py checks the answer at b and b + 4)"),
    Override(r"jaxckpt-fit .*--preset llama3\.1-8b", "--preset tiny --topology v5e:2x2 --seq-len 64 "
             "--global-batch-size 16 --memory 64MiB --policies nothing_saveable "
             "save_and_offload_only_these_names:/decoder_layer_input+query_proj+key_proj+value_proj+out_proj",
             "Llama 3.1 8B on 256 chips compiles 2-4 min per program on 2 cores (7.6 min for docs/fit.md's search); "
             "llama tiny on v5e:2x2 runs the same mesh search with both policies, offload included (after the "
             "--topology override above, so its memory and policies win)"),
    Override(r"jaxckpt-fit .*--preset llama3\.1-70b .*--topology h200", "--preset tiny --topology h100:2x8 "
             "--seq-len 128 --global-batch-size 32 --memory 64MiB --max-meshes 1",
             "Llama 3.1 70B on 256 H200s: 25 XLA:GPU compiles, 1 min 44 s on 2 cores (docs/gpu.md); the tiny preset on "
             "two nodes of H100s runs the same mesh search over nodes (after the --topology override above, so its "
             "sizes win)"),
    Override(r"jaxckpt-(report|fit) .*--preset mixtral-8x(7|22)b", "--preset mixtral-tiny --layers 2 --topology v5e:2x2 "
             "--seq-len 256", "Mixtral on 256 chips compiles for 10–30 min per program on 2 cores (docs/llm.md's "
             "figures); the tiny Mixtral on 4 chips runs the same path, its dispatch and the offload included (after "
             "the --topology and --model overrides above, so its sizes win)"),
    Override(r"jaxckpt-report .*--preset mixtral-8x(7|22)b", "--mesh fsdp=2,expert=2 --batch-size 8",
             "the expert axis on the 4 chips of the shrunk report"),
    Override(r"jaxckpt-fit .*--preset mixtral-8x(7|22)b", "--global-batch-size 8 --memory 64MiB --max-meshes 2",
             "the mesh search of the shrunk fit: the 4 chips' meshes, an expert axis among them"),
    Override(r"jaxckpt-plan .*--budget (\d+%|auto)", "--preset tiny",
             "a relative budget (percent, auto) means the same on the tiny preset"),
    Override(r"jaxckpt-plan .*--mincut \d+%", "--preset tiny",
             "a relative cap (percent of no remat's saved activations) means the same on the tiny preset"),
)

SLOW: tuple[tuple[str, str], ...] = (
    (r"jaxckpt-plan .*--budget \d+(\.\d+)?[KMG]i?B", "an absolute budget is tied to the model size: not shrunk"),
    (r"--policies all", "compiles every policy of the model"),
    (r"--measure", "runs every policy in a fresh process"),
    (r"--num-processes", "starts a multi-process run (gloo collectives)"),
    (r"budget:|jaxckpt-plan .*--budget", "plans a budget: several compiles"),
    (r"mincut", "plans a whole-loss min-cut: traces, cuts and solves the loss, then compiles"),
    (r"--mesh", "compiles for 8 fake devices"),
    (r"jaxckpt-fit|python -m jaxckpt\.fit", "an absolute memory is tied to the model size: compiles at several batch "
     "sizes per policy, not shrunk"),
    (r"python -m experiments\.", "trains a model in a fresh process (a minute or more per block on 2 cores)"),
    (r"--topology", "compiles with the TPU compiler (seconds to minutes per compile on 2 cores) or XLA:GPU (seconds)"),
    (r"jaxckpt-report --model (gpt|llm) --preset (small|gemma2-tiny) --policies",
     "a report of several policies, one compile each: 20–35 s for the block on 2 cores"),
)
"""``(pattern, reason)``: blocks with a matching command are marked ``slow``."""

NEEDS_COMPILER: tuple[tuple[str, bool, str], ...] = (
    (r"--topology +v\d", extras.HAS_LIBTPU or extras.REQUIRE_TPU,
     "compiles with the TPU compiler of libtpu: " + extras.TPU_REASON),
    (r"--topology +(a100|h100|h200|b200)", extras.HAS_CUDA_PLUGIN or extras.REQUIRE_GPU,
     "compiles with XLA:GPU of JAX's CUDA plugin: " + extras.GPU_REASON),
)
"""``(pattern, runs, reason)``: blocks with a matching command need that compiler (an optional extra,
:mod:`tests.extras`): skipped without it, unless ``JAXCKPT_REQUIRE_TPU=1`` / ``JAXCKPT_REQUIRE_GPU=1``."""


def _npz_images(root: Path) -> None:
  rng = np.random.default_rng(0)
  np.savez(root / "my_images.npz", x=rng.random((160, 8, 8), dtype=np.float32),
           y=np.arange(160, dtype=np.int64) % 10)


def _text_corpus(root: Path) -> None:
  corpus = root / "my_texts"
  corpus.mkdir()
  for i in range(4):
    (corpus / f"part{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400 + str(i))


_TARGET_SOURCE = '''
import jax, jax.numpy as jnp
import jaxckpt
from jaxckpt.report import LossTarget


def target():
  def loss(params, batch, *, policy):
    block = jaxckpt.checkpoint(lambda w, x: jnp.tanh(x @ w), policy, block_type="mlp")
    h = batch["x"]                                   # [B, D] float32
    for w in params["w"]:                            # L x [D, D] float32
      h = block(w, h)
    return jnp.mean(h ** 2)
  d = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  return LossTarget(loss, params={"w": [d] * 2}, batch={"x": jax.ShapeDtypeStruct((8, 32), jnp.float32)},
                    block_types={"mlp": set()}, name="my-mlp")
'''


def _target_package(root: Path) -> None:
  package = root / "mypkg"
  package.mkdir(exist_ok=True)
  (package / "__init__.py").write_text("")
  (package / "targets.py").write_text(_TARGET_SOURCE)


def _llama_package(root: Path) -> None:
  """``mypkg/llama.py``: the Llama of docs/sharding.md's tensor-plan example, written as public Flax code writes one
  (the tests' own: ``tests/sharding/own_llama.py``)."""
  package = root / "mypkg"
  package.mkdir(exist_ok=True)
  (package / "__init__.py").write_text("")
  (package / "llama.py").write_text((REPO / "tests" / "sharding" / "own_llama.py").read_text())


SETUP: tuple[tuple[str, Callable[[Path], None]], ...] = (
    (r"my_images\.npz", _npz_images),
    (r"my_texts/", _text_corpus),
    (r"mypkg\.targets:", _target_package),
    (r"mypkg\.llama:", _llama_package),
)
"""``(pattern, make)``: when a block's commands match, ``make(workdir)`` creates the user's files first."""


@dataclasses.dataclass(frozen=True)
class Block:
  line: int  # 1-based line of the opening fence
  language: str
  text: str
  page: str = "README.md"  # path relative to the repository

  @property
  def where(self) -> str:
    return f"{self.page}:{self.line}"

  @property
  def id(self) -> str:
    return f"{self.page}:L{self.line}-{self.language or 'text'}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
  """The fenced code blocks of a Markdown text (``page``: its path, for ids and messages), in order."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    opening = re.match(r"^(\s*)(```+)\s*([\w+-]*)\s*$", lines[i])
    if not opening:
      i += 1
      continue
    indent, fence, language = opening.groups()
    body, j = [], i + 1
    while j < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[j]):
      body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
      j += 1
    blocks.append(Block(i + 1, language.lower(), "\n".join(body), page))
    i = j + 1
  return blocks


def shell_commands(text: str) -> list[str]:
  """A shell block's commands: continuations joined, comments and blank lines dropped."""
  joined = re.sub(r"\s*\\\n\s*", " ", text)
  commands = []
  for line in joined.splitlines():
    line = re.sub(r"(^|\s)#(\s.*)?$", "", line).strip()
    if line:
      commands.append(line)
  return commands


def skip_reason(command: str) -> str | None:
  return next((reason for pattern, reason in SKIP if pattern.search(command)), None)


def shrink(command: str) -> str:
  """Appends every matching override's arguments (before a trailing ``&``)."""
  background = command.endswith("&")
  body = command[:-1].rstrip() if background else command
  for override in OVERRIDES:
    if re.search(override.pattern, body):
      body = f"{body} {override.extra}"
  return f"{body} &" if background else body


def _is_display(block: Block) -> bool:
  return any(line.startswith(">>> ") for line in block.text.splitlines())


def _page_name(path: Path) -> str:
  return path.relative_to(REPO).as_posix()


def first_occurrences(blocks: list[Block]) -> list[Block]:
  """``blocks`` without the ones repeating an earlier block's language and text (they would run the same code)."""
  seen: set[tuple[str, str]] = set()
  out = []
  for block in blocks:
    key = (block.language, block.text.strip())
    if key not in seen:
      seen.add(key)
      out.append(block)
  return out


ALL_BLOCKS = [b for path in PAGES for b in readme_blocks(path.read_text(encoding="utf-8"), _page_name(path))]
"""Every fenced block of every page, repeats included."""
BLOCKS = first_occurrences(ALL_BLOCKS)
SHELL_BLOCKS = [b for b in BLOCKS if b.language in SHELL_LANGUAGES]
PYTHON_BLOCKS = [b for b in BLOCKS if b.language in PYTHON_LANGUAGES and not _is_display(b)]
DISPLAY_BLOCKS = [b for b in BLOCKS if b.language in PYTHON_LANGUAGES and _is_display(b)]


def _slow(commands: list[str]) -> str | None:
  return next((reason for pattern, reason in SLOW for c in commands if re.search(pattern, c)), None)


def _params(blocks: list[Block], commands_of: Callable[[Block], list[str]] = lambda b: []) -> list:
  out = []
  for block in blocks:
    reason = _slow(commands_of(block))
    out.append(pytest.param(block, id=block.id, marks=[pytest.mark.slow] if reason else []))
  return out


@pytest.mark.parametrize("page", [_page_name(p) for p in PAGES])
def test_every_fence_language_has_a_rule(page: str):
  languages = {b.language for b in ALL_BLOCKS if b.page == page}
  unknown = sorted(languages - set(RUN_LANGUAGES) - set(TEXT_LANGUAGES))
  assert not unknown, f"{page}: fences with no run/not-run rule in tests/house/test_readme.py: {unknown}"


def test_every_page_and_kind_of_block_is_found():
  """The pages are README.md and the manual, and between them they hold all three kinds of runnable block."""
  assert README in PAGES and len(PAGES) > 1 and all(p.parent.name == "docs" for p in PAGES[1:])
  assert SHELL_BLOCKS and PYTHON_BLOCKS and DISPLAY_BLOCKS
  assert "README.md" in {b.page for b in BLOCKS if b.language in RUN_LANGUAGES}


def test_tables_match_the_readme():
  """Every override, slow and setup pattern matches some example command (the tables cannot rot either)."""
  commands = [c for b in SHELL_BLOCKS for c in shell_commands(b.text)]
  for pattern in [o.pattern for o in OVERRIDES] + [p for p, _ in SLOW] + [p[0] for p in NEEDS_COMPILER] + \
      [p for p, _ in SETUP]:
    assert any(re.search(pattern, c) for c in commands), f"pattern {pattern!r} matches no example command"


def heading_anchors(text: str) -> set[str]:
  """GitHub's anchors for a Markdown text's ``#`` headings: lower case, code marks and punctuation dropped (``-`` and
  ``_`` kept), spaces as ``-``; a repeated heading gets ``-1``, ``-2``, …"""
  anchors: set[str] = set()
  for line in _prose(text).splitlines():
    heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if heading:
      slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
      anchor, n = slug, 0
      while anchor in anchors:
        n += 1
        anchor = f"{slug}-{n}"
      anchors.add(anchor)
  return anchors


def _prose(text: str) -> str:
  """``text`` without its fenced blocks (whose lines are code, not links or headings)."""
  out, fence = [], None
  for line in text.splitlines():
    opening = re.match(r"^\s*(```+)", line)
    if fence is None and opening:
      fence = opening.group(1)
    elif fence is not None and re.match(rf"^\s*{fence}\s*$", line):
      fence = None
    elif fence is None:
      out.append(line)
  return "\n".join(out)


def relative_links(text: str) -> list[str]:
  """The targets of a Markdown text's links and images that are not URLs (``scheme:``), outside code."""
  prose = re.sub(r"`[^`\n]*`", "", _prose(text))
  return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"^[a-zA-Z][\w+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_relative_links_point_at_files(page: Path):
  """Every relative link of a page names a file that exists (relative to the page), and its ``#anchor``, if any, a
  heading of the Markdown file it names."""
  links = relative_links(page.read_text(encoding="utf-8"))
  bad = []
  for link in links:
    path, _, anchor = link.partition("#")
    target = (page.parent / path).resolve() if path else page
    if not target.exists():
      bad.append(f"{link} (no file {target.relative_to(REPO) if target.is_relative_to(REPO) else target})")
    elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target.read_text(encoding="utf-8")):
      bad.append(f"{link} (no heading with anchor #{anchor} in {_page_name(target)})")
  assert not bad, f"{_page_name(page)}: broken links: {bad}"


def test_link_rules():
  """Links in code are not links; anchors follow GitHub's rule; URLs are not checked."""
  text = "# A `b:c`, d\n## A `b:c`, d\n[x](y.md#z) `[no](no.md)` [u](https://e.org) ![i](p.png)\n```\n[no](no)\n```\n"
  assert relative_links(text) == ["y.md#z", "p.png"]
  assert heading_anchors(text) == {"a-bc-d", "a-bc-d-1"}
  assert heading_anchors("### `mincut:<cap>`: the plan, one region\n") == {"mincutcap-the-plan-one-region"}


def test_parsing_rules():
  """The parser joins continuations, drops comments, skips install lines and appends overrides before ``&``."""
  text = "# a comment\nfoo --a 1 \\\n    --b 2 &   # trailing\n\npython3 -m venv .venv && pip install -e .\n"
  (first, install) = shell_commands(text)
  assert first == "foo --a 1 --b 2 &"
  assert skip_reason(install) is not None and skip_reason(first) is None
  assert shrink("python -m experiments.lm --policy full &").endswith("--no-progress &")
  assert shrink("jaxckpt-plan --model vit --preset small --budget 14MiB --export").endswith("--export")
  blocks = readme_blocks("x\n```bash\na\n```\n```\nb\n```\n")
  assert [(b.line, b.language, b.text) for b in blocks] == [(2, "bash", "a"), (5, "", "b")]
  again = readme_blocks("```bash\na\n```\n```python\na\n```\n", page="docs/x.md")
  assert [b.id for b in first_occurrences(blocks + again)] == ["README.md:L2-bash", "README.md:L5-text",
                                                               "docs/x.md:L4-python"]
  assert skip_reason("python -m pytest -q -n 2 --dist loadfile") is not None


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
  # Examples set their own XLA_FLAGS inline; the test run's fast code generation (tests/conftest.py) is kept, nothing
  # else of the runner's flags.
  fast = [f for f in env.pop("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization_level")]
  if fast:
    env["XLA_FLAGS"] = " ".join(fast)
  return env


@pytest.mark.parametrize("block", _params(SHELL_BLOCKS, lambda b: shell_commands(b.text)))
def test_shell_example_runs(block: Block, tmp_path: Path):
  commands = [c for c in shell_commands(block.text) if skip_reason(c) is None]
  if not commands:
    reasons = sorted({skip_reason(c) for c in shell_commands(block.text)})
    pytest.skip(f"{block.where}: nothing to run ({'; '.join(reasons)})")
  for pattern, runs, reason in NEEDS_COMPILER:
    if any(re.search(pattern, c) for c in commands) and not runs:
      pytest.skip(f"{block.where}: {reason}")
  for pattern, make in SETUP:
    if any(re.search(pattern, c) for c in commands):
      make(tmp_path)
  script = "\n".join(["set -euo pipefail", *map(shrink, commands),
                      'for job in $(jobs -p); do wait "$job"; done'])
  done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                        timeout=1800)
  assert done.returncode == 0, (
      f"{block.where} failed (exit {done.returncode}):\n{script}\n--- output (tail) ---\n"
      f"{(done.stdout + done.stderr)[-4000:]}")


@pytest.mark.parametrize("block", _params(PYTHON_BLOCKS))
def test_python_example_runs(block: Block, tmp_path: Path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  exec(compile(block.text, block.where, "exec", dont_inherit=True), {"__name__": "__readme__"})  # noqa: S102


def _display_steps(text: str) -> list[tuple[str, list[str]]]:
  steps: list[tuple[str, list[str]]] = []
  for line in text.splitlines():
    if line.startswith(">>> "):
      steps.append((line[4:], []))
    elif line.startswith("... ") and steps:
      steps[-1] = (steps[-1][0] + "\n" + line[4:], steps[-1][1])
    elif line.strip() and steps:
      steps[-1][1].append(line)
  return steps


@pytest.mark.parametrize("block", _params(DISPLAY_BLOCKS))
def test_display_example_says_what_it_shows(block: Block):
  import jax
  import jax.numpy as jnp

  import jaxckpt

  namespace = {"jax": jax, "jnp": jnp, "jaxckpt": jaxckpt}
  for statement, shown in _display_steps(block.text):
    error = re.match(r"^(\w+(?:Error|Exception|Warning)): (.*)$", shown[0]) if shown else None
    if error is None:
      exec(compile(statement, block.where, "single"), namespace)  # noqa: S102
      continue
    name, message = error.groups()
    with pytest.raises(Exception) as raised:
      exec(compile(statement, block.where, "single"), namespace)  # noqa: S102
    assert type(raised.value).__name__ == name
    pattern = ".*".join(re.escape(part) for part in message.split("..."))
    assert re.fullmatch(pattern, str(raised.value), re.S), (message, str(raised.value))
