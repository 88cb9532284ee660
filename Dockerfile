# The stepstream services, for docker-compose.yml. The broker comes from the apache/kafka image.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY eventstore eventstore
COPY projections projections
COPY scheduler scheduler
COPY agents agents
COPY supervisor supervisor
COPY stepstream stepstream
COPY demo demo
RUN pip install --no-cache-dir .
ENV STEPSTREAM_HOME=/data PYTHONUNBUFFERED=1
ENTRYPOINT ["stepstream"]
