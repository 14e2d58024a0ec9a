{{/*
The operator's permissions: exactly the API calls of operator/ and of kopf on its behalf.
tests/test_chart_rbac.py derives the same list from the source (kopf's handler registry and the
KubeApi call sites), so a new call without a rule, or a rule nobody uses, fails CI.
*/}}

{{/* Cluster-scoped reads, whatever namespaces are served. */}}
{{- define "tandem.operator.clusterRules" -}}
# The node index of placement (kopf.index: list + watch).
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch]
# kopf finds the resources it serves by watching the CRDs.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- if .Values.operator.watchNamespaces }}
# Serving a list of namespaces, kopf watches them come and go.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
{{- end }}

{{/* Namespaced rules: in the ClusterRole (all namespaces) or in one Role per served namespace. */}}
{{- define "tandem.operator.namespacedRules" -}}
# The served resource: kopf lists and watches it and patches finalizers and progress annotations,
# the handlers patch its status.
- apiGroups: [tandem.dev]
  resources: [tandemservices]
  verbs: [list, watch, patch]
- apiGroups: [tandem.dev]
  resources: [tandemservices/status]
  verbs: [patch]
# kopf.adopt sets blockOwnerDeletion on the children's owner references, which clusters with the
# OwnerReferencesPermissionEnforcement admission plugin allow only with this.
- apiGroups: [tandem.dev]
  resources: [tandemservices/finalizers]
  verbs: [update]
# Pod indexes (list + watch), the Pod Security dry run of a cell's pod (create), and deleting a
# worker that runs on another node than its scheduler (delete).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
# A cell's children: created or merge-patched, deleted on scale-down (the cells' Services only
# by GC; the endpoint picker's when the routing changes).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch, delete]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [list, create, patch, delete]
# The endpoint picker of gateway and standalone routing, and standalone routing's Envoy:
# created or merge-patched, read until available, deleted when the routing changes (and an
# earlier version's router Deployment, wherever one is left).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, delete]
# Gateway routing's InferencePools (Gateway API Inference Extension): created or merge-patched,
# deleted when the routing changes. list and watch: what the endpoint picker's Role grants
# (below), which Kubernetes lets the operator grant only if it holds it (as it holds pods').
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, watch, create, patch, delete]
# Gateway routing's endpoint picker watches the pools with an account of its own: its
# ServiceAccount, a Role that lists and watches pods and InferencePools, and their binding;
# created or merge-patched, deleted when the routing changes.
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, patch, delete]
# The TLS Secret of a service (tls.secretName), read to verify its cells' certificate when the
# operator reads their CacheStats (cache sizing): get only, never list or watch.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
# Segment cleanup Jobs: created once, then read until they finish.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create]
# Events: kopf posts handler retries and permanent failures (settings.posting in the
# operator's startup), the handlers post repairs, scale-down and cleanup problems.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
