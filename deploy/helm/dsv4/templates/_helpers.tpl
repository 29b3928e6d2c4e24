{{/* Names and labels. */}}
{{- define "dsv4.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dsv4.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dsv4.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsv4.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsv4.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "dsv4.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dsv4
{{- end -}}

{{- define "dsv4.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Where the service reads the checkpoint (`--model`): a directory on the model volume, a Hugging Face repo
id (`org/name@revision`, fetched by the service into the cache on that volume) for source hub, or empty for
the built-in tiny model. */}}
{{- define "dsv4.modelDir" -}}
{{- if eq .Values.model.source "hub" -}}
{{- $repo := required "model.hub.repo is required when model.source is hub" .Values.model.hub.repo -}}
{{- ternary (printf "%s@%s" $repo .Values.model.hub.revision) $repo (ne .Values.model.hub.revision "") -}}
{{- else if ne .Values.model.source "builtin" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.path -}}
{{- end -}}
{{- end -}}

{{- define "dsv4.tokenSecretName" -}}
{{- if .Values.model.tokenSecret.create -}}
{{- printf "%s-model-token" (include "dsv4.fullname" .) -}}
{{- else -}}
{{- .Values.model.tokenSecret.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding Ray's token under `auth_token` (KubeRay authOptions.secretName). */}}
{{- define "dsv4.rayAuthSecretName" -}}
{{- if .Values.rayAuth.secret.create -}}
{{- printf "%s-ray-auth" (include "dsv4.fullname" .) -}}
{{- else -}}
{{- required "rayAuth.secret.name is required when rayAuth.secret.create is false" .Values.rayAuth.secret.name -}}
{{- end -}}
{{- end -}}

{{/* "true" when PodMonitor / PrometheusRule can be created. */}}
{{- define "dsv4.monitoringAPI" -}}
{{- if or .Values.monitoring.assumeMonitoringAPI (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* Total workers (engines) of a role: replicas x workersPerPod. Argument: the role's values. */}}
{{- define "dsv4.roleWorkers" -}}
{{- mul (int .replicas) (int .workersPerPod) -}}
{{- end -}}

{{/* "true" when the planner sizes a role's pool: elastic with minReplicas < maxReplicas. Argument: the role's values. */}}
{{- define "dsv4.roleElastic" -}}
{{- if and .enabled .elastic (lt (int .minReplicas) (int .maxReplicas)) -}}
true
{{- end -}}
{{- end -}}

{{/* The builder's worker count of a role: replicas x workersPerPod, or "MIN:MAX" workers of an elastic pool. */}}
{{- define "dsv4.roleWorkerSpec" -}}
{{- if include "dsv4.roleElastic" . -}}
{{- printf "%d:%d" (mul (int .minReplicas) (int .workersPerPod)) (mul (int .maxReplicas) (int .workersPerPod)) -}}
{{- else -}}
{{- include "dsv4.roleWorkers" . -}}
{{- end -}}
{{- end -}}

{{/* Pods a worker group starts with: minReplicas when elastic (the planner starts there), else replicas. */}}
{{- define "dsv4.roleReplicas" -}}
{{- ternary .minReplicas .replicas (eq (include "dsv4.roleElastic" .) "true") -}}
{{- end -}}

{{/* Ranks (Ray actors, one GPU each on CUDA) in one pod of a role: workersPerPod x tensorParallelSize. */}}
{{- define "dsv4.podRanks" -}}
{{- mul (int .workersPerPod) (int (default 1 .tensorParallelSize)) -}}
{{- end -}}

{{/* rayStartParams `resources`: a JSON object quoted for the shell line KubeRay builds. */}}
{{- define "dsv4.rayResources" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") -}}
{{- end -}}

{{/* rayStartParams of a group. Arguments: root, role ("head", "prefill", "decode"), group values. */}}
{{- define "dsv4.rayStartParams" -}}
{{- $root := .root -}}
{{- $params := dict "metrics-export-port" (toString $root.Values.metrics.rayMetricsPort) -}}
{{- if eq .role "head" -}}
{{- $_ := set $params "dashboard-host" "0.0.0.0" -}}
{{- $_ := set $params "num-gpus" "0" -}}
{{- if $root.Values.head.extraRayResources -}}
{{- $_ := set $params "resources" (include "dsv4.rayResources" $root.Values.head.extraRayResources) -}}
{{- end -}}
{{- else -}}
{{- $ranks := include "dsv4.podRanks" .group | int -}}
{{- $gpus := mulf (float64 $ranks) (float64 $root.Values.serve.gpusPerWorker) -}}
{{- $_ := set $params "num-gpus" (toString (ceil $gpus | int)) -}}
{{- /* one unit of the role's resource per rank: every rank's placement bundle takes one */ -}}
{{- $_ := set $params "resources" (include "dsv4.rayResources" (dict (printf "dsv4_%s" .role) $ranks)) -}}
{{- end -}}
{{- range $k, $v := .group.rayStartParams -}}
{{- $_ := set $params $k (toString $v) -}}
{{- end -}}
{{- toYaml $params -}}
{{- end -}}

{{/* Container resources of a worker group: the values plus GPUs (workersPerPod x tensorParallelSize x
gpusPerWorker) and RDMA devices per pod. */}}
{{- define "dsv4.workerResources" -}}
{{- $root := .root -}}
{{- $res := deepCopy (default dict .group.resources) -}}
{{- $limits := default dict $res.limits -}}
{{- $requests := default dict $res.requests -}}
{{- $ranks := include "dsv4.podRanks" .group | int -}}
{{- $gpus := ceil (mulf (float64 $ranks) (float64 $root.Values.serve.gpusPerWorker)) | int -}}
{{- if gt $gpus 0 -}}
{{- $_ := set $limits $root.Values.gpu.resourceKey $gpus -}}
{{- $_ := set $requests $root.Values.gpu.resourceKey $gpus -}}
{{- end -}}
{{- if $root.Values.rdma.enabled -}}
{{- $_ := set $limits $root.Values.rdma.resourceName (int $root.Values.rdma.count) -}}
{{- $_ := set $requests $root.Values.rdma.resourceName (int $root.Values.rdma.count) -}}
{{- end -}}
{{- $_ := set $res "limits" $limits -}}
{{- $_ := set $res "requests" $requests -}}
{{- toYaml $res -}}
{{- end -}}
