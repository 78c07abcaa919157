# Prometheus from Debian's package, on the same base as the Interleaf image (no registry
# needed). Built by docker/build-images.sh; compose mounts docker/prometheus.yml over
# /etc/prometheus/prometheus.yml.
ARG BASE=interleaf-base:bookworm
FROM ${BASE}
# Without recommends: the node exporter and the web console libraries are not wanted here.
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*
# The package's own user and data folder (made by its postinst).
USER prometheus
WORKDIR /var/lib/prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2", \
     "--web.listen-address=:9090"]
