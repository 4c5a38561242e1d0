"""Every command-line tool's ``--help``: ``prog`` is ``python -m ...``, every option has help text that
ends with its default, and descriptions hold no reST markup.

The parsers are captured in this process (``parse_args`` raises before any work), not by spawning each
tool: that keeps 25 CLIs under a few seconds. A failure names the tool and the option to document.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

import pytest

CLIS = [
    "bigconv.check", "experiments.alternatives", "experiments.bench_compile", "experiments.bench_core",
    "experiments.bench_slides",
    "experiments.checkpoint_cost", "experiments.cluster.run", "experiments.cluster.train_spmd", "experiments.context",
    "experiments.demo",
    "experiments.dsn_target_only", "experiments.faults", "experiments.fig7", "experiments.gpu_check",
    "experiments.grad_group_cost", "experiments.host_bound",
    "experiments.maxsize", "experiments.memory_probe", "experiments.planner", "experiments.pyramid_write",
    "experiments.gpu_planner", "experiments.gpu_loop", "experiments.lightning_step", "experiments.ring_attention",
    "experiments.runtime_costs",
    "experiments.spmd_overhead", "experiments.step_time_ab", "experiments.sweep", "experiments.verdict_panel",
    "experiments.whole_slide", "experiments.zoo_coverage",
    "multidsn.train", "plots",
    "plots.alternatives", "plots.context", "plots.context_curves", "plots.core", "plots.dsn", "plots.dsn_paper", "plots.tables",
]
"""Every ``python -m`` tool."""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def captured_parser(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    def capture(self, *args, **kwargs):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [module_name, "--help"])
    module = importlib.import_module(module_name + (".__main__" if module_name == "plots" else ""))
    main = module.main
    try:
        main([]) if inspect.signature(main).parameters else main()
    except _Captured as got:
        return got.parser
    raise AssertionError(f"{module_name}.main() never parsed its arguments")


INTERNAL = {"bigconv.harness.runner", "bigconv.runtime.worker", "experiments.cluster.env", "experiments.runs"}
"""Modules run with ``python -m`` by bigconv itself (a fresh measuring process, a worker, a launch shim)."""


def test_every_module_with_a_main_guard_is_listed():
    root = Path(__file__).resolve().parent.parent
    found = set()
    for package in ("bigconv", "experiments", "multidsn", "plots"):
        for path in (root / package).rglob("*.py"):
            if '__name__ == "__main__"' in path.read_text():
                name = ".".join(path.relative_to(root).with_suffix("").parts)
                found.add(name.removesuffix(".__main__"))
    assert found - INTERNAL - set(CLIS) == set(), "add these CLIs to CLIS (their --help is then checked)"


@pytest.mark.parametrize("module_name", CLIS)
def test_every_option_has_help_and_its_default(module_name, monkeypatch):
    parser = captured_parser(module_name, monkeypatch)
    assert parser.prog == f"python -m {module_name}"
    assert "``" not in (parser.description or ""), "reST markup in the description"
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{module_name}: {name} has no help text"
        text = formatter._get_help_string(action)
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in text.lower(), f"{module_name}: {name}'s help does not show its default"
    parser.format_help()  # every %(default)s and %(choices)s expands


@pytest.mark.parametrize("module_name", CLIS)
def test_no_option_names_its_default_twice(module_name, monkeypatch):
    """A help that names its default itself gets no second ``(default: None)`` appended (issue 53 item 9)."""
    parser = captured_parser(module_name, monkeypatch)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            text = formatter._expand_help(action)
            assert text.count("(default:") <= 1, f"{module_name}: {'/'.join(action.option_strings)}: {text!r}"


def test_check_link_options_list_their_own_links(monkeypatch):
    """``--link`` offers the links within a node, ``--inter`` those between nodes (issue 53 item 9)."""
    parser = captured_parser("bigconv.check", monkeypatch)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert "nvlink4" in helps["--link"] and "pcie5" in helps["--link"] and "ib-" not in helps["--link"]
    assert "ib-ndr" in helps["--inter"] and "slingshot" in helps["--inter"] and "nvlink" not in helps["--inter"]
