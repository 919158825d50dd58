"""``extras.extra_hint``: an extra that does not import says what failed and how to fix it, from the package's
own metadata (the real ImportError, what is installed against what the extra asks for)."""

from __future__ import annotations

from importlib import metadata

from agentjet_client.errors import extra_hint, extra_requirements


def test_the_requirements_of_an_extra_come_from_the_installed_metadata():
    assert extra_requirements("agentjet-client", "mcp") == ["mcp<2,>=1.20"]
    assert extra_requirements("agentjet-server", "lora") == ["peft>=0.13"]
    assert extra_requirements("agentjet-client", "no-such-extra") == []
    assert extra_requirements("no-such-package", "mcp") == []


def test_an_installed_package_that_fails_to_import_shows_the_real_error_and_the_version_to_install():
    error = ModuleNotFoundError("No module named 'mcp.server.fastmcp'")
    hint = extra_hint("the MCP server", "mcp", error)
    assert "No module named 'mcp.server.fastmcp'" in hint  # the real error, not a generic hint
    assert f"installed: mcp {metadata.version('mcp')}" in hint and "asks for mcp<2,>=1.20" in hint
    assert "pip install 'agentjet-client[mcp]'" in hint


def test_a_missing_package_names_the_extra_what_it_brings_and_the_error(monkeypatch):
    real = metadata.version

    def without_wandb(name: str) -> str:  # as where wandb is not installed
        if name == "wandb":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without_wandb)
    hint = extra_hint("--log-to wandb", "wandb", ModuleNotFoundError("No module named 'wandb'"), "agentjet-server")
    assert hint == (
        "--log-to wandb needs the wandb extra (wandb>=0.17): pip install 'agentjet-server[wandb]' "
        "(ModuleNotFoundError: No module named 'wandb')"
    )
