{{/*
The operator's permissions, exactly the API calls in operator/ (tests/test_chart_rbac.py compares
them with the source, so a new call without a rule, or a rule nobody uses, fails CI).
*/}}

{{/* Cluster-scoped reads, needed whatever namespaces are watched. */}}
{{- define "tandem.operator.clusterRules" -}}
# Placement: the node index (allocatable GPU and memory, labels, taints).
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
# kopf resolves the resources it serves from the CRDs.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
# kopf follows the set of namespaces it serves.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}

{{/* Namespaced rules: in the ClusterRole (all namespaces) or in one Role per watched namespace. */}}
{{- define "tandem.operator.namespacedRules" -}}
# The served resource: handlers, finalizer and progress annotations, status.
- apiGroups: [tandem.dev]
  resources: [tandemservices]
  verbs: [get, list, watch, patch]
- apiGroups: [tandem.dev]
  resources: [tandemservices/status]
  verbs: [get, patch]
# The pod index (colocation checks) and repair of misplaced workers.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch, delete]
# Children of each cell.
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, patch, delete]
# Segment cleanup on deletion.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# kopf posts handler outcomes and repairs as Events.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
