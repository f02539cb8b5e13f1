"""Shell completion scripts generated from the CLI's argparse parser.

Generated, not written by hand, so a new subcommand or option completes without edits here:
options complete after ``-``, an option's choices (``--policy``) after it, a path option's
value (``-f``, ``--store``) and every other argument as a path, unless it has choices.
bash gets a ``complete -F`` function; zsh loads the same function through ``bashcompinit``.
"""

from __future__ import annotations

import argparse

_BASH = """\
_kernelcache() {{
    local cur prev command i words
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    command=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            -*) ;;
            *) command="${{COMP_WORDS[i]}}"; break ;;
        esac
    done
    COMPREPLY=()
    case "$command" in
{cases}
    esac
}}
complete -o filenames -F _kernelcache kernelcache
"""

# What an option's value or a positional argument completes to.
_PATHS = '$(compgen -f -- "$cur")'


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _takes_path(action: argparse.Action) -> bool:
    return getattr(action.type, "__name__", "") in ("Path", "path")


def _value_completion(action: argparse.Action) -> str | None:
    """The words an argument's value completes to: its choices, paths, or nothing."""
    if action.choices:
        return f'$(compgen -W "{" ".join(map(str, action.choices))}" -- "$cur")'
    if _takes_path(action) or not action.option_strings:
        return _PATHS
    return None


def _case(name: str, parser: argparse.ArgumentParser, words: list[str]) -> str:
    """One subcommand's branch: the value of the option before the cursor, else options
    after ``-``, else its positional arguments (choices or paths)."""
    lines = [f"        {name})", '            case "$prev" in']
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        found = _value_completion(action)
        value = f"COMPREPLY=({found})" if found else "COMPREPLY=()"
        lines.append(f"                {'|'.join(action.option_strings)}) {value}; return ;;")
    lines.append("            esac")
    options = [o for action in parser._actions for o in action.option_strings]
    positional = [
        found
        for action in parser._actions
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction)
        for found in [_value_completion(action)]
        if found
    ]
    listed = f'COMPREPLY=($(compgen -W "{" ".join(options + words)}" -- "$cur"))'
    if positional:
        listed = f'if [[ "$cur" == -* ]]; then {listed}; else COMPREPLY=({positional[0]}); fi'
    lines.append(f"            {listed} ;;")
    return "\n".join(lines)


def bash(parser: argparse.ArgumentParser) -> str:
    commands = subcommands(parser)
    cases = [_case(name, sub, []) for name, sub in commands.items()]
    cases.append(_case('""', parser, list(commands)))
    return _BASH.format(cases="\n".join(cases))


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    if shell == "bash":
        return bash(parser)
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser)
    raise ValueError(f"no completion for {shell}")
