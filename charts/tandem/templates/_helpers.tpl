{{/* Names: resource names are "<fullname>-<component>", capped at 63 characters. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- $name := include "tandem.name" . }}
{{- $full := .Values.fullnameOverride }}
{{- if not $full }}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) }}
{{- end }}
{{- $full | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of one component's resources; call with (list $ "operator"). */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" (index . 0)) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels never change across upgrades (a Deployment's selector is immutable); everything
that may change goes into "tandem.labels" only. Call both with (list $ "<component>").
*/}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version | replace "+" "_" }}
{{- end }}

{{/* The image of the cells' components (the operator appends -cuda for CUDA workers). */}}
{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The slim operator image: the operator and the chart's hook jobs (kubernetes client only). */}}
{{- define "tandem.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (.Values.operator.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The TandemService's name: the CRD allows 39 characters, a DNS label starting with a
letter (children append suffixes; <name>-63-scheduler must leave room for pod labels). */}}
{{- define "tandem.serviceName" -}}
{{- $name := .Values.service.name | default (include "tandem.fullname" .) }}
{{- if gt (len $name) 39 }}
{{- fail (printf "the TandemService name %q is longer than 39 characters: set service.name" $name) }}
{{- end }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "the TandemService name %q must be lower-case letters, digits and '-', start with a letter and end with a letter or digit: set service.name" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "tandem.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "tandem.componentName" (list . "operator")) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The OTLP endpoint every component exports to: the bundled collector, else the bundled Jaeger,
else tracing.endpoint (empty = tracing off).
*/}}
{{- define "tandem.otlpEndpoint" -}}
{{- if .Values.tracing.collector.enabled }}
{{- printf "http://%s.%s.svc:4317" (include "tandem.componentName" (list . "collector")) .Release.Namespace }}
{{- else if .Values.tracing.jaeger.enabled }}
{{- printf "http://%s.%s.svc:4317" (include "tandem.componentName" (list . "jaeger")) .Release.Namespace }}
{{- else }}
{{- .Values.tracing.endpoint }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every pod the chart renders. */}}
{{- define "tandem.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
