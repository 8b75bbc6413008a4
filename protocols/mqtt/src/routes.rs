//! Which ledger topic an MQTT topic name goes to, which ledger topics an MQTT filter must
//! follow, and under which MQTT name a ledger record is delivered (DESIGN.md, "Protocol
//! mapping").

use serde::{Deserialize, Serialize};

use crate::topic;

/// One route: MQTT names matching `filter` are stored in ledger topic `topic`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    pub filter: String,
    pub topic: String,
}

#[derive(Debug, Clone)]
pub(crate) struct Routes {
    routes: Vec<Route>,
    /// Where names that match no route go; `None` refuses them.
    default: Option<String>,
}

/// Checks a topic that publishes are routed to: a valid name, and not one of the gateway's
/// internal topics (which clients may not write, through MQTT either).
fn ledger_topic(name: &str) -> Result<(), String> {
    sluice_core::validate_topic_name(name).map_err(|e| e.to_string())?;
    if sluice_core::is_internal_topic(name) {
        return Err(format!(
            "publishes cannot be routed to {name:?}: topics starting with `__` are the gateway's own"
        ));
    }
    Ok(())
}

impl Routes {
    pub(crate) fn new(routes: Vec<Route>, default_topic: &str) -> Result<Self, String> {
        for r in &routes {
            if !topic::valid_filter(&r.filter) {
                return Err(format!(
                    "route filter {:?} is not a valid MQTT topic filter",
                    r.filter
                ));
            }
            ledger_topic(&r.topic)?;
        }
        let default = (!default_topic.is_empty()).then(|| default_topic.to_owned());
        if let Some(d) = &default {
            ledger_topic(d)?;
        }
        Ok(Self { routes, default })
    }

    /// The ledger topic for a published MQTT topic name: the first matching route's.
    pub(crate) fn topic_for(&self, name: &str) -> Option<&str> {
        self.routes
            .iter()
            .find(|r| topic::matches(&r.filter, name))
            .map(|r| r.topic.as_str())
            .or(self.default.as_deref())
    }

    /// Every ledger topic that may hold records an MQTT subscription to `filter` wants.
    pub(crate) fn topics_for_filter(&self, filter: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.routes {
            if topic::overlaps(&r.filter, filter) && !out.contains(&r.topic) {
                out.push(r.topic.clone());
            }
        }
        if let Some(d) = &self.default
            && !out.contains(d)
        {
            out.push(d.clone());
        }
        // Records produced by Kafka or REST clients under keys that are not MQTT names are
        // delivered under their topic's name: a filter may also name a ledger topic directly.
        if topic::valid_name(filter)
            && sluice_core::validate_topic_name(filter).is_ok()
            && !out.iter().any(|t| t == filter)
        {
            out.push(filter.to_owned());
        }
        out
    }

    /// The MQTT name a record of `ledger_topic` is delivered under: its key when the key is an
    /// MQTT topic name that routes to this topic, otherwise the ledger topic's name.
    pub(crate) fn name_for(&self, ledger_topic: &str, key: Option<&[u8]>) -> String {
        if let Some(name) = key.and_then(|k| std::str::from_utf8(k).ok())
            && topic::valid_name(name)
            && self.topic_for(name) == Some(ledger_topic)
        {
            return name.to_owned();
        }
        ledger_topic.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes() -> Routes {
        Routes::new(
            vec![
                Route {
                    filter: "cameras/+/jpeg".into(),
                    topic: "camera-images".into(),
                },
                Route {
                    filter: "cars/#".into(),
                    topic: "telemetry".into(),
                },
            ],
            "mqtt",
        )
        .unwrap()
    }

    #[test]
    fn publish_routing_and_default() {
        let r = routes();
        assert_eq!(r.topic_for("cameras/7/jpeg"), Some("camera-images"));
        assert_eq!(r.topic_for("cars/42/speed"), Some("telemetry"));
        assert_eq!(r.topic_for("sensors/1"), Some("mqtt"));
        let strict = Routes::new(vec![], "").unwrap();
        assert_eq!(strict.topic_for("anything"), None);
        assert!(
            Routes::new(
                vec![Route {
                    filter: "a/#/b".into(),
                    topic: "t".into()
                }],
                "mqtt"
            )
            .is_err()
        );
        // Nothing may be routed into the gateway's own topics.
        let into_sessions = vec![Route {
            filter: "x/#".into(),
            topic: "__mqtt_sessions".into(),
        }];
        assert!(Routes::new(into_sessions, "mqtt").is_err());
        assert!(Routes::new(vec![], "__mqtt_retained").is_err());
    }

    #[test]
    fn subscriptions_follow_every_topic_that_may_match() {
        let r = routes();
        assert_eq!(
            r.topics_for_filter("cameras/#"),
            vec!["camera-images", "mqtt"]
        );
        assert_eq!(
            r.topics_for_filter("#"),
            vec!["camera-images", "telemetry", "mqtt"]
        );
        assert_eq!(r.topics_for_filter("telemetry"), vec!["mqtt", "telemetry"]);
    }

    #[test]
    fn delivery_names_round_trip() {
        let r = routes();
        // MQTT → ledger → MQTT keeps the name.
        assert_eq!(
            r.name_for("camera-images", Some(b"cameras/7/jpeg")),
            "cameras/7/jpeg"
        );
        // A key that does not route to this topic (a Kafka producer's own key) is not a name.
        assert_eq!(
            r.name_for("camera-images", Some(b"device-9")),
            "camera-images"
        );
        assert_eq!(r.name_for("telemetry", None), "telemetry");
        assert_eq!(r.name_for("mqtt", Some(b"sensors/1")), "sensors/1");
    }
}
