"""Shell completion scripts generated from the CLI's argparse parser.

Generated, not written by hand, so a new subcommand or option completes without edits here.
bash gets a ``complete -F`` function; zsh loads the same function through ``bashcompinit``.
"""

from __future__ import annotations

import argparse

_BASH = """\
_kernelcache() {{
    local cur command i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    command=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            -*) ;;
            *) command="${{COMP_WORDS[i]}}"; break ;;
        esac
    done
    case "$command" in
{cases}
    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
    if [[ ${{#COMPREPLY[@]}} -eq 0 && "$cur" != -* ]]; then
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -o filenames -F _kernelcache kernelcache
"""


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _words(parser: argparse.ArgumentParser) -> list[str]:
    """The options of a parser, and the choices of its positional arguments."""
    words: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        words.extend(action.option_strings)
        if not action.option_strings and action.choices:
            words.extend(str(c) for c in action.choices)
    return words


def bash(parser: argparse.ArgumentParser) -> str:
    commands = subcommands(parser)
    top = [*commands, *_words(parser)]
    cases = [f'        "") words="{" ".join(top)}" ;;']
    cases += [
        f'        {name}) words="{" ".join(_words(sub))}" ;;' for name, sub in commands.items()
    ]
    cases.append('        *) words="" ;;')
    return _BASH.format(cases="\n".join(cases))


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    if shell == "bash":
        return bash(parser)
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + bash(parser)
    raise ValueError(f"no completion for {shell}")
