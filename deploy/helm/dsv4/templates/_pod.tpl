{{/*
The pod template of a Ray group. Arguments: root (the chart context), role ("head", "prefill" or
"decode"), group (that role's values). The Ray container comes first (KubeRay builds `ray start` into
it); the metrics exporter sidecar serves the pod's dsv4 multiprocess directory on port `metrics`,
declared on the Ray container so that KubeRay adds no port of its own with that name.
*/}}
{{- define "dsv4.podTemplate" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $group := .group -}}
{{- $worker := ne .role "head" -}}
{{- $rdma := and $worker $v.rdma.enabled -}}
{{- $annotations := merge (dict) (default dict $group.podAnnotations) (ternary $v.rdma.podAnnotations (dict) $rdma) -}}
metadata:
  labels:
    {{- /* no chart version here: a chart bump alone must not roll a new Ray cluster */}}
    {{- include "dsv4.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/part-of: dsv4
    app.kubernetes.io/component: {{ .role }}
    {{- with $group.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $rdma }}
  hostNetwork: {{ $v.rdma.hostNetwork }}
  hostIPC: {{ $v.rdma.hostIPC }}
  {{- if $v.rdma.hostNetwork }}
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- end }}
  {{- with $group.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $group.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if eq $v.model.source "download" }}
  initContainers:
    - name: model-download
      image: {{ default (include "dsv4.image" $root) $v.model.download.image }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- if $v.model.download.command }}
      command:
        {{- toYaml $v.model.download.command | nindent 8 }}
      {{- else }}
      command:
        - sh
        - -c
        - >-
          if [ -f "$DSV4_MODEL_DIR/config.json" ]; then echo "model already in $DSV4_MODEL_DIR"; exit 0; fi;
          hf download "$DSV4_MODEL_REPO" --revision "$DSV4_MODEL_REVISION" --local-dir "$DSV4_MODEL_DIR"
      {{- end }}
      env:
        - name: DSV4_MODEL_REPO
          value: {{ required "model.download.repo is required when model.source is download" $v.model.download.repo | quote }}
        - name: DSV4_MODEL_REVISION
          value: {{ $v.model.download.revision | quote }}
        - name: DSV4_MODEL_DIR
          value: {{ include "dsv4.modelDir" $root | quote }}
        {{- with include "dsv4.tokenSecretName" $root }}
        - name: {{ $v.model.tokenSecret.envName }}
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $v.model.tokenSecret.key }}
        {{- end }}
      {{- with $v.model.download.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: model
          mountPath: {{ $v.model.mountPath }}
  {{- end }}
  containers:
    - name: ray-{{ .role }}
      image: {{ include "dsv4.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      env:
        - name: DSV4_ROLE
          value: {{ .role }}
        {{- /* every Serve proxy bounds request heads and bodies at its socket (service.http_limits) */}}
        - name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
          value: service.http_limits:proxy_callback
        {{- /* the token path's Serve settings (service.serve_front PROXY_SERVE_ENV / REPLICA_SERVE_ENV): proxy to
               replicas over gRPC, routing and the app on their main loops (BENCHMARKS.md frontdoor) */}}
        - name: RAY_SERVE_PROXY_USE_GRPC
          value: "1"
        - name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
          value: "0"
        - name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
          value: "0"
        {{- if eq $v.serve.frontDoor "haproxy" }}
        {{- /* HAProxy in front of the replicas' own ports (service.serve_front haproxy_env) */}}
        - name: RAY_SERVE_ENABLE_HA_PROXY
          value: "1"
        - name: RAY_SERVE_HAPROXY_BINARY_PATH
          value: {{ $v.serve.haproxy.launcher | quote }}
        - name: RAY_SERVE_HAPROXY_TUNE_BUFSIZE
          value: {{ add (int $v.serve.httpLimits.maxHeaderBytes) 1024 | quote }}
        - name: RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S
          value: {{ ceil $v.serve.httpLimits.bodyTimeoutSeconds | int | quote }}
        - name: RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
          value: "2.0"
        - name: RAY_SERVE_HAPROXY_NBTHREAD
          value: {{ $v.serve.haproxy.threads | int | quote }}
        - name: RAY_SERVE_HAPROXY_STATS_PORT
          value: {{ $v.serve.haproxy.statsPort | int | quote }}
        - name: RAY_SERVE_HAPROXY_METRICS_PORT
          value: {{ $v.serve.haproxy.metricsPort | int | quote }}
        - name: DSV4_HAPROXY_ADMIN_HOST
          value: "0.0.0.0"
        {{- end }}
        - name: DSV4_HTTP_MAX_HEADER_BYTES
          value: {{ $v.serve.httpLimits.maxHeaderBytes | int | quote }}
        - name: DSV4_HTTP_HEADER_TIMEOUT_S
          value: {{ $v.serve.httpLimits.headerTimeoutSeconds | toString | quote }}
        - name: DSV4_HTTP_BODY_TIMEOUT_S
          value: {{ $v.serve.httpLimits.bodyTimeoutSeconds | toString | quote }}
        {{- with $v.serve.apiKeySecret.name }}
        - name: DSV4_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $v.serve.apiKeySecret.key }}
        {{- end }}
        {{- if $rdma }}
        {{- range $name, $value := $v.rdma.ucxEnv }}
        - name: {{ $name }}
          value: {{ $value | toString | quote }}
        {{- end }}
        {{- end }}
        {{- if eq $v.model.source "hub" }}
        {{- /* the service fetches the repo itself (engine.loading.model_source) into this cache on the model volume */}}
        - name: HF_HUB_CACHE
          value: {{ $v.model.mountPath | quote }}
        {{- with include "dsv4.tokenSecretName" $root }}
        - name: {{ $v.model.tokenSecret.envName }}
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $v.model.tokenSecret.key }}
        {{- end }}
        {{- end }}
        - name: DG_JIT_CACHE_DIR
          value: {{ printf "%s/deep_gemm" $v.compileCache.mountPath | quote }}
        - name: TRITON_CACHE_DIR
          value: {{ printf "%s/triton" $v.compileCache.mountPath | quote }}
        {{- with $group.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        {{- if not $worker }}
        - name: gcs-server
          containerPort: 6379
        - name: dashboard
          containerPort: 8265
        - name: client
          containerPort: 10001
        {{- end }}
        - name: serve
          containerPort: {{ $v.serve.port }}
        - name: metrics
          containerPort: {{ $v.metrics.port }}
        - name: ray-metrics
          containerPort: {{ $v.metrics.rayMetricsPort }}
        {{- if eq $v.serve.frontDoor "haproxy" }}
        - name: haproxy-metrics
          containerPort: {{ $v.serve.haproxy.metricsPort }}
        {{- end }}
      resources:
        {{- if $worker }}
        {{- include "dsv4.workerResources" (dict "root" $root "group" $group) | nindent 8 }}
        {{- else }}
        {{- toYaml $group.resources | nindent 8 }}
        {{- end }}
      {{- if and $rdma $v.rdma.ipcLock }}
      securityContext:
        capabilities:
          add:
            - IPC_LOCK
      {{- end }}
      {{- if $v.startupProbe.enabled }}
      startupProbe:
        httpGet:
          path: /api/local_raylet_healthz
          port: 52365
        periodSeconds: {{ $v.startupProbe.periodSeconds }}
        timeoutSeconds: {{ $v.startupProbe.timeoutSeconds }}
        failureThreshold: {{ $v.startupProbe.failureThreshold }}
      {{- end }}
      volumeMounts:
        - name: dsv4-metrics
          mountPath: {{ $v.metrics.multiprocDir }}
        - name: kernel-cache
          mountPath: {{ $v.compileCache.mountPath }}
        {{- if $v.shm.enabled }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- if ne $v.model.source "builtin" }}
        - name: model
          mountPath: {{ $v.model.mountPath }}
          readOnly: {{ ne $v.model.source "hub" }}
        {{- end }}
    - name: metrics-exporter
      image: {{ include "dsv4.image" $root }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - python
        - -m
        - service.kuberay_app
        - exporter
        - --port
        - {{ $v.metrics.port | quote }}
      env:
        - name: PROMETHEUS_MULTIPROC_DIR
          value: {{ $v.metrics.multiprocDir }}
      resources:
        {{- toYaml $v.metrics.exporter.resources | nindent 8 }}
      volumeMounts:
        - name: dsv4-metrics
          mountPath: {{ $v.metrics.multiprocDir }}
  volumes:
    - name: dsv4-metrics
      emptyDir: {}
    - name: kernel-cache
      {{- toYaml $v.compileCache.volume | nindent 6 }}
    {{- if $v.shm.enabled }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $v.shm.sizeLimit }}
    {{- end }}
    {{- if eq $v.model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $v.model.pvc.claimName }}
        readOnly: {{ $v.model.pvc.readOnly }}
    {{- else if eq $v.model.source "hostPath" }}
    - name: model
      hostPath:
        path: {{ required "model.hostPath.path is required when model.source is hostPath" $v.model.hostPath.path }}
        type: {{ $v.model.hostPath.type }}
    {{- else if eq $v.model.source "hub" }}
    - name: model
      {{- toYaml $v.model.hub.volume | nindent 6 }}
    {{- else if eq $v.model.source "download" }}
    - name: model
      {{- toYaml $v.model.download.volume | nindent 6 }}
    {{- end }}
{{- end -}}
