"""Kopf operator for TandemService resources.

Importing the package registers the handlers, so `kopf run -m tandem_operator` and
`tandem operator` (tandem_operator.main.run) serve the same operator.
"""

from tandem_operator import handlers as handlers
