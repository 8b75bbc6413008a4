use kafka_protocol::messages::ApiVersionsResponse;

use crate::versions;

pub(crate) fn handle(read_only: bool) -> ApiVersionsResponse {
    let mut r = ApiVersionsResponse::default();
    r.api_keys = versions::advertised(read_only);
    r
}
