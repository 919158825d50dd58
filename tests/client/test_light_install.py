"""``pip install ./packages/agentjet-client`` in a fresh venv brings neither torch nor transformers."""

import subprocess
from pathlib import Path

from tests.conftest import fresh_venv

ROOT = Path(__file__).resolve().parents[2]
LISTING = "from importlib import metadata; print('\\n'.join(d.metadata['Name'] for d in metadata.distributions()))"


def test_client_install_pulls_no_torch(tmp_path):
    env_dir = tmp_path / "venv"
    py = fresh_venv(env_dir, str(ROOT / "packages" / "agentjet-client"))
    listing = subprocess.run([str(py), "-c", LISTING], check=True, capture_output=True, text=True).stdout.lower()
    names = {name.replace("_", "-") for name in listing.split()}
    assert "agentjet-client" in names
    for heavy in ("torch", "transformers", "langchain", "agentscope", "anthropic", "vllm", "matplotlib"):
        pulled = [n for n in names if n == heavy or n.startswith(heavy + "-") or n.startswith(heavy + "_")]
        assert not pulled, f"{pulled} was installed with agentjet-client"
    out = subprocess.run(
        [str(py), "-c", "import agentjet_client, sys; print('torch' in sys.modules)"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "False"
    # the framework adapters say what to install, instead of failing on an import deep inside
    probe = (
        "from agentjet_client import SwarmClient\n"
        "episode = SwarmClient('http://127.0.0.1:9').episode('task')\n"
        "for adapter in (episode.langchain, episode.agentscope, episode.anthropic):\n"
        "    try:\n"
        "        adapter()\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    out = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True, timeout=60)
    assert "pip install 'agentjet-client[langchain]'" in out.stdout
    assert "pip install 'agentjet-client[agentscope]'" in out.stdout
    assert "pip install 'agentjet-client[anthropic]'" in out.stdout
    # a study's report without matplotlib: the leaderboard and the best configuration, and what to
    # install for the plots
    out = tmp_path / "study"
    out.mkdir()
    digits = ROOT / "examples" / "digits"
    (out / "study.toml").write_text(
        f'[trial]\nepisodes = 10\n[client]\ncode_dir = "{digits}"\n[space]\n"server.lr" = [0.001]\n'
    )
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from agentjet_client.research.trial import StudyState, TrialDir, TrialRecord, write_atomic\n"
        "out = Path(sys.argv[1])\n"
        "state = StudyState(name='light', study_file=str(out / 'study.toml'), study_hash='-', trials=['t000'],"
        " parallel=1, parallel_reason='-')\n"
        "write_atomic(out / 'study.json', state.model_dump_json())\n"
        "TrialDir(out, 't000').save(TrialRecord(id='t000', index=0, settings={'server.lr': 0.001}, phase='done',"
        " status='finished', metric=0.5, target_episodes=10, episodes=10))\n"
    )
    subprocess.run([str(py), "-c", probe, str(out)], check=True, timeout=60)
    cli = env_dir / "bin" / "agentjet-client"
    subprocess.run([str(cli), "research", "report", str(out)], check=True, capture_output=True, timeout=60)
    report = (out / "report.md").read_text()
    missing = "No plots: the report needs the research extra (matplotlib>=3.7): pip install 'agentjet-client[research]'"
    assert missing in report
    assert "| 1 | t000 | 0.001 | 0.500 |" in report
    assert (out / "best-server.toml").read_text().endswith("lr = 0.001\n")
