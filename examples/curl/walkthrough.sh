#!/usr/bin/env bash
# One episode over plain HTTP: create a session, chat with its key, post the reward,
# end the session, look at it. Needs curl and jq and a running gateway:
#   areal-service serve &        # then:
#   examples/curl/walkthrough.sh
# ADMIN defaults to the key the gateway generated in ./data (on loopback, when no
# gateway.auth.admin_key is set); BASE to the default address.
set -euo pipefail
BASE=${BASE:-http://127.0.0.1:8000}
ADMIN=${ADMIN:-$(cat data/admin_key)}
MODEL=${MODEL:-gpt-4o-mini}   # any name: the gateway serves its policy under it

# 1. a session (the admin key opens it; the reply holds the session's own key)
SESSION=$(curl -sf -X POST "$BASE/rl/sessions" -H "Authorization: Bearer $ADMIN" \
  -H 'content-type: application/json' -d '{"task_id": "curl-demo"}')
SID=$(jq -r .session_id <<<"$SESSION")
KEY=$(jq -r .api_key <<<"$SESSION")
echo "session $SID"

# 2. chat with the session key: the completion is recorded in the session
REPLY=$(curl -sf "$BASE/v1/chat/completions" -H "Authorization: Bearer $KEY" \
  -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"What is 2 + 3?\"}]}")
# -c: the reply as one JSON string (a model's text may hold newlines)
echo "reply: $(jq -c '.choices[0].message.content' <<<"$REPLY")"

# 3. the reward, with the same key (a judge could use the admin key instead)
curl -sf -X POST "$BASE/v1/rewards" -H "Authorization: Bearer $KEY" \
  -H 'content-type: application/json' -d "{\"session_id\": \"$SID\", \"value\": 1.0}" \
  | jq -c '{id, value, session_id}'

# 4. end the episode: once ended and rewarded, it is ready for the trainer
curl -sf -X POST "$BASE/rl/sessions/$SID/end" -H "Authorization: Bearer $KEY" \
  | jq -c '{session_id, status, completions}'

# 5. what the store holds for it
curl -sf "$BASE/rl/sessions/$SID" -H "Authorization: Bearer $ADMIN" \
  | jq -c '{status, end_reason, completions: (.completions | length), rewards: [.rewards[].value]}'
