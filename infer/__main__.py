"""`python -m infer ...`: the `infer` console script, for a checkout or a venv whose bin/ is not on PATH (and for a
newcomer who types it first; it was "No module named infer.__main__; 'infer' is a package and cannot be directly
executed")."""

from .cli.entry import main

if __name__ == "__main__":  # (imported, by pydoc or a doctest run, it runs nothing)
    main()
