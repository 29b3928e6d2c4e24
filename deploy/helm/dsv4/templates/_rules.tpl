{{/*
SLO alerts (the spec of the PrometheusRule; deploy/prometheus/dsv4-rules.yaml is this, rendered with the
default values, for a Prometheus without the operator). Ratios are ratios of 5m rates.
*/}}
{{- define "dsv4.ruleGroups" -}}
{{- $r := .Values.monitoring.prometheusRule -}}
{{- $sev := $r.severityLabel -}}
groups:
  - name: dsv4-slo
    rules:
      - alert: Dsv4TimeToFirstTokenP99High
        expr: >-
          histogram_quantile(0.99, sum by (namespace, model_name, le)
          (rate(dsv4_time_to_first_token_seconds_bucket[5m]))) > {{ $r.ttftP99Seconds }}
        for: {{ $r.for }}
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `p99 time to first token of {{ $labels.model_name }} in {{ $labels.namespace }} is {{ $value | humanizeDuration }}` | quote }}
          description: >-
            The 99th percentile of arrival to first token (queue, prefill and KV transfer) is above
            {{ $r.ttftP99Seconds }}s: add prefill workers or check the transfer dashboards.
      - alert: Dsv4ErrorRatioHigh
        expr: >-
          sum by (namespace, model_name) (rate(dsv4_requests_total{status="error"}[5m]))
          / sum by (namespace, model_name) (rate(dsv4_requests_total[5m])) > {{ $r.errorRatio }}
        for: 5m
        labels:
          {{ $sev }}: critical
        annotations:
          summary: {{ `{{ $value | humanizePercentage }} of {{ $labels.model_name }} requests in {{ $labels.namespace }} fail` | quote }}
          description: Requests ending with a server error (5xx) are above {{ mulf $r.errorRatio 100 }}% of all.
      - alert: Dsv4KVCacheUsageHigh
        expr: >-
          max by (namespace, role, worker) (dsv4_kv_cache_usage_ratio) > {{ $r.kvCacheUsageRatio }}
        for: {{ $r.for }}
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `KV cache of {{ $labels.role }} worker {{ $labels.worker }} in {{ $labels.namespace }} is {{ $value | humanizePercentage }} full` | quote }}
          description: >-
            A worker's tightest cache group stays above {{ mulf $r.kvCacheUsageRatio 100 }}% use: requests
            queue for pages; scale that role or lower max-num-seqs.
      - alert: Dsv4KernelCompilesWhileServing
        expr: >-
          sum by (namespace, role, worker) (increase(dsv4_kernel_compiles_total[15m])) > 0
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `{{ $labels.role }} worker {{ $labels.worker }} in {{ $labels.namespace }} compiled {{ $value }} kernel variants while serving` | quote }}
          description: >-
            Kernels compiled in a serving step after the start-up warm-up, each stalling its step (and every request
            in it) for seconds: a shape the warm-up does not cover. The worker's log names the kernels.
      - alert: Dsv4CollectorPausesLong
        expr: >-
          histogram_quantile(0.99, sum by (namespace, component, le)
          (rate(dsv4_gc_pause_seconds_bucket[15m]))) > {{ $r.gcPauseP99Seconds }}
        for: {{ $r.for }}
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `p99 Python collector pause of the {{ $labels.component }} processes in {{ $labels.namespace }} is {{ $value | humanizeDuration }}` | quote }}
          description: >-
            Each collector pass pauses its whole process: a worker's step, or every stream of an ingress replica,
            router or proxy. Passes this long mean objects that are never garbage left in the collector's walks (a
            start-up heap not frozen) or request objects in reference cycles (engine.runtime.gc_pauses).
      - alert: Dsv4KVTransferFailures
        expr: >-
          sum by (namespace) (rate(dsv4_kv_transfer_failures_total[5m]))
          / (sum by (namespace) (rate(dsv4_kv_transfer_failures_total[5m]))
          + (sum by (namespace) (rate(dsv4_kv_transfer_time_seconds_count[5m]))
          or sum by (namespace) (rate(dsv4_kv_transfer_failures_total[5m])) * 0))
          > {{ $r.transferFailureRatio }}
        for: 5m
        labels:
          {{ $sev }}: critical
        annotations:
          summary: {{ `{{ $value | humanizePercentage }} of KV transfers in {{ $labels.namespace }} fail` | quote }}
          description: >-
            More than {{ mulf $r.transferFailureRatio 100 }}% of prefill-to-decode cache transfers fail or
            time out (each failed pull counted once; cancelled requests are aborts, not failures): check the
            RDMA/UCX settings and the transfer failures panel by kind.
      - alert: Dsv4PrefixCacheHitRatioDropped
        expr: >-
          sum by (namespace) (rate(dsv4_prefix_cache_hit_tokens_total[30m]))
          / sum by (namespace) (rate(dsv4_prefix_cache_query_tokens_total[30m]))
          < {{ $r.prefixHitRatioDrop }} * (sum by (namespace) (rate(dsv4_prefix_cache_hit_tokens_total[1d]))
          / sum by (namespace) (rate(dsv4_prefix_cache_query_tokens_total[1d])))
        for: {{ $r.for }}
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `prefix-cache hit ratio in {{ $labels.namespace }} fell to {{ $value | humanizePercentage }}` | quote }}
          description: >-
            The engines' real prefix-cache hit ratio (prompt tokens served from cache / prompt tokens looked
            up) over 30 minutes is below {{ mulf $r.prefixHitRatioDrop 100 }}% of its one-day level: workers
            restarted (empty caches), the router lost the workers' cache digests (check prefix_hit among
            the prefill decisions), or the traffic changed.
      - alert: Dsv4KVHandoffExposedP99High
        expr: >-
          histogram_quantile(0.99, sum by (namespace, streamed, le)
          (rate(dsv4_kv_handoff_exposed_seconds_bucket[5m]))) > {{ $r.handoffExposedP99Seconds }}
        for: {{ $r.for }}
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `p99 KV hand-off time exposed after the prefill (streamed={{ $labels.streamed }}) in {{ $labels.namespace }} is {{ $value | humanizeDuration }}` | quote }}
          description: >-
            The 99th percentile of the hand-off time the prefill does not hide (its result to the caches landing
            on the decode worker, all of it in time to first token) is above {{ $r.handoffExposedP99Seconds }}s:
            check the KV transfer throughput and failure panels, and whether long prompts take the streamed
            hand-off (streamed="true" on the hand-off panels).
      - alert: Dsv4PoolWorkerNeverReady
        expr: >-
          sum by (namespace, pool) (increase(dsv4_pool_start_failures_total[15m])) > 0
        labels:
          {{ $sev }}: warning
        annotations:
          summary: {{ `workers added to the {{ $labels.pool }} pool in {{ $labels.namespace }} never became ready` | quote }}
          description: >-
            The elastic pool planner added workers that it gave up on before they served (no free GPU or
            resource unit, a model that fails to load, a start-up past its limit): the pool stays below the
            size it wants. The service log names each start failure.
{{- end -}}
