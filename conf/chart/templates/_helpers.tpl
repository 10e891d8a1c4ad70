{{/* The port of config.metrics_addr: the container port "metrics", probed
and scraped. The probes need it, so "off" is refused here. */}}
{{- define "ctscrub.metricsPort" -}}
{{- $port := regexFind "[0-9]+$" (toString .Values.config.metrics_addr) -}}
{{- if or (not $port) (eq (toString .Values.config.metrics_addr) "off") -}}
{{- fail (printf "config.metrics_addr %q: the chart needs host:port (default ${HOST_IP}:9967): the probes use /healthz and /readyz there" (toString .Values.config.metrics_addr)) -}}
{{- end -}}
{{- $port -}}
{{- end -}}
