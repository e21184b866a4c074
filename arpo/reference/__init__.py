"""Text generated from the code so it cannot drift from it: the entry points' ``--help``, the metrics glossary
(the one registry of logged metric names) and the docs site's generated pages."""
