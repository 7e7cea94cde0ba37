"""MkDocs hook: the reference pages are written from the code at build time, so they cannot drift from it.

A page holds a marker comment where a generated section goes: `<!-- cli-reference -->` becomes every command of
`llmlower.cli.build_parser()` (usage, description, options), `<!-- pass-reference -->` every registered pass
with its own explanation (`llmlower.passes.PASSES`), `<!-- recipe-reference -->` the named recipes
(`llmlower.recipes.RECIPES`).
"""

from __future__ import annotations

import argparse
from typing import Any

CLI_MARKER = "<!-- cli-reference -->"
PASS_MARKER = "<!-- pass-reference -->"
RECIPE_MARKER = "<!-- recipe-reference -->"
USAGE_WIDTH = 100  # argparse wraps usage to the terminal otherwise, so the page would depend on who built it


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each marker the page holds with its generated markdown."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if PASS_MARKER in markdown:
        markdown = markdown.replace(PASS_MARKER, pass_reference())
    if RECIPE_MARKER in markdown:
        markdown = markdown.replace(RECIPE_MARKER, recipe_reference())
    return markdown


def cli_reference() -> str:
    """Every subcommand of the command line: its usage, what it does and a table of its options by group."""
    from llmlower.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    sections = [f"`{parser.prog}`: {parser.description}"]
    for name, command in commands.choices.items():
        sections.append(command_section(name, command, helps.get(name) or command.description or ""))
    return "\n\n".join(sections) + "\n"


def command_section(name: str, command: argparse.ArgumentParser, summary: str) -> str:
    """One command: heading, summary, usage block and one options table per argument group that has options."""
    formatter = argparse.HelpFormatter(command.prog, width=USAGE_WIDTH)
    formatter.add_usage(command.usage, command._actions, command._mutually_exclusive_groups, prefix="")
    usage = formatter.format_help().strip()
    lines = [f"### `{name}`", "", capitalized(summary) + ".", "", "```text", usage, "```"]
    for group in command._action_groups:
        actions = [action for action in group._group_actions if not isinstance(action, argparse._HelpAction)]
        if not actions:
            continue
        lines += ["", f"**{capitalized(group.title)}**", "", "| argument | default | meaning |"]
        lines += ["|---|---|---|"]
        lines += [option_row(formatter, action) for action in actions]
    return "\n".join(lines)


def option_row(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """A table row for one argument: its flags (with metavar or choices), its default and its help."""
    names = ", ".join(action.option_strings) or action.dest
    if action.nargs != 0:
        if action.choices is not None:
            names += " {" + ",".join(str(choice) for choice in action.choices) + "}"
        elif action.option_strings:
            names += " " + (action.metavar or action.dest.upper())
    default = action.default
    shown = "" if default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    meaning = formatter._expand_help(action) if action.help else ""
    if action.required and action.option_strings:
        meaning = "required; " + meaning
    return f"| `{names}` | {shown} | {table_cell(meaning)} |"


def pass_reference() -> str:
    """Every registered pass, in registration order: its summary, whether the default pipeline runs it, and its
    explanation, the text `llmlower passes --explain NAME` prints."""
    from llmlower.passes import DEFAULT_PIPELINE, PASSES

    sections = []
    for name, registered in PASSES.items():
        where = "in the default pipeline" if name in DEFAULT_PIPELINE else "not in the default pipeline"
        tolerance = registered.tolerance if not callable(registered.tolerance) else "depends on its options"
        summary = literal(capitalized(registered.summary))
        heading = f"### `{name}`\n\n*{summary}* ({where}; `--verify` tolerance: {tolerance})"
        sections.append(f"{heading}\n\n{literal(registered.explain)}")
    return "\n\n".join(sections) + "\n"


def recipe_reference() -> str:
    """The named recipes, fastest first, as `auto` tries them: the flags each stands for, the CPUs it is for and its
    measured perplexity over fp32 on each held-out text."""
    from llmlower.recipes import QUALITY_TEXTS, RECIPES

    lines = ["| recipe | flags | for | " + " | ".join(f"{text}.txt" for text in QUALITY_TEXTS) + " | what it is |"]
    lines.append("|---|---|---|" + "---:|" * len(QUALITY_TEXTS) + "---|")
    for recipe in RECIPES.values():
        machines = " or ".join("+".join(sorted(m)) for m in recipe.machines) or "any CPU"
        quality = [f"+{recipe.quality[t]}%" if t in recipe.quality else "fp32" for t in QUALITY_TEXTS]
        cells = [f"`{recipe.name}`", f"`{recipe.flags}`", machines, *quality, table_cell(recipe.summary)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table_cell(text: str) -> str:
    """Plain text that stays inside one markdown table cell."""
    return literal(" ".join(text.split())).replace("|", "\\|")


def literal(text: str) -> str:
    """Plain text (help strings, pass explanations) as markdown that shows it as written: `k_cache_<i>` must not
    open an HTML tag, nor `x*1 ... y*2` an emphasis. Spans in backticks stay code, as written."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):  # the parts outside backticks
        for char in "\\*_[]":
            parts[index] = parts[index].replace(char, "\\" + char)
        parts[index] = parts[index].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def capitalized(text: str) -> str:
    """Text with its first letter upper-case (argparse's titles and the pass summaries start lower-case)."""
    return text[:1].upper() + text[1:]
