{{/* Names. */}}
{{- define "kvlingo.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvlingo.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvlingo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvlingo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvlingo.labels" -}}
{{ include "kvlingo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvlingo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvlingo.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image: the tag defaults to appVersion, "-cuda" for the CUDA flavour. */}}
{{- define "kvlingo.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if and (eq .Values.image.flavor "cuda") (not .Values.image.tag) -}}
{{- $tag = printf "%s-cuda" $tag -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* Grace period: at least preStop sleep + drain; 0 = that plus 15 s. */}}
{{- define "kvlingo.gracePeriod" -}}
{{- $need := add .Values.preStopSleepSeconds .Values.kvlingod.drainSeconds -}}
{{- $set := int .Values.terminationGracePeriodSeconds -}}
{{- if eq $set 0 -}}
{{- add $need 15 -}}
{{- else if lt $set (int $need) -}}
{{- fail (printf "terminationGracePeriodSeconds %d is shorter than preStopSleepSeconds + kvlingod.drainSeconds = %d: streams would be cut" $set (int $need)) -}}
{{- else -}}
{{- $set -}}
{{- end -}}
{{- end -}}

{{/* Checks across values that a schema cannot express. */}}
{{- define "kvlingo.validate" -}}
{{- if not (has .Values.workload (list "Deployment" "StatefulSet")) -}}
{{- fail (printf "workload must be Deployment or StatefulSet (got %s)" .Values.workload) -}}
{{- end -}}
{{- if not (has .Values.image.flavor (list "cpu" "cuda")) -}}
{{- fail (printf "image.flavor must be cpu or cuda (got %s)" .Values.image.flavor) -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled .Values.keda.enabled -}}
{{- fail "autoscaling.enabled and keda.enabled both scale the workload: turn one off" -}}
{{- end -}}
{{- if and (eq .Values.models.volume.type "perReplica") (ne .Values.workload "StatefulSet") -}}
{{- fail "models.volume.type perReplica needs workload: StatefulSet" -}}
{{- end -}}
{{- if and .Values.spill.persistent (ne .Values.workload "StatefulSet") -}}
{{- fail "spill.persistent needs workload: StatefulSet" -}}
{{- end -}}
{{- if and .Values.kvlingod.tls.enabled (not .Values.kvlingod.tls.secretName) -}}
{{- fail "kvlingod.tls.enabled needs kvlingod.tls.secretName" -}}
{{- end -}}
{{- end -}}

{{/* The daemon's probe action: gRPC health, or HTTP /health when gRPC has TLS. */}}
{{- define "kvlingo.probeAction" -}}
{{- if .Values.kvlingod.tls.enabled -}}
httpGet:
  path: /health
  port: http
{{- else -}}
grpc:
  port: {{ .Values.kvlingod.grpcPort }}
  service: ""
{{- end -}}
{{- end -}}
