"""Greenlane on more than one GPU: replicas on Ray Serve behind one ingress, routed by prefix
affinity (README "More than one GPU").

Modules: `routing` (routing key and choice, pure Python), `router` (Ray's request-router API),
`replica` (a Greenlane server driven over raw HTTP), `deployment` (the Serve deployments and
`build_app`), `ingress` (the HTTP front), `config`, `cli` (`greenlane cluster`).
Only `routing` and `config` import without the `cluster` extra (`pip install -e .[cluster]`).
"""
