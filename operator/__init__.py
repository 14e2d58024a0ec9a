"""Kopf operator for TandemService resources (import name ``tandem_operator``).

Importing the package registers the handlers, so `kopf run -m tandem_operator` and
`tandem operator` (tandem_operator.main.run) serve the same operator.
"""

if __name__ == "operator":
    # NOTE: Python was started in this checkout (``python -m ...`` puts the working directory
    # first on sys.path) before the standard library's ``operator`` was imported, so this
    # folder is being imported in its place. Become the standard module rather than break
    # ``collections``: the Tandem operator is only ever imported as ``tandem_operator``.
    import os as _os

    _stdlib = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(_stdlib, encoding="utf-8") as _source:
        exec(compile(_source.read(), _stdlib, "exec"))
else:
    from tandem_operator import handlers as handlers
